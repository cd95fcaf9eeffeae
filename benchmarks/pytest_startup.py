"""Startup cost of the dtcompile pytest plugin for a project that does not use it.

An unrelated one-test file is run with ``python -m pytest`` in a fresh
process, alternately with the plugin loaded (as it is wherever dtcompile is
installed) and with ``-p no:dtcompile``; the table gives the median wall time
of each and their ratio, measured side by side in one run.  The plugin
imports neither torch nor dtcompile until one of its fixtures runs, so the
ratio should be about 1.

    python benchmarks/pytest_startup.py --runs 10
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEST = "def test_one():\n    assert 1 + 1 == 2\n"


def run_once(folder: Path, extra: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, "test_unrelated.py"],
        cwd=folder,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each configuration (alternating)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "test_unrelated.py").write_text(TEST)
        run_once(folder, [])  # warm the file cache
        with_plugin, without = [], []
        for _ in range(args.runs):
            with_plugin.append(run_once(folder, []))
            without.append(run_once(folder, ["-p", "no:dtcompile"]))
    a, b = statistics.median(with_plugin), statistics.median(without)
    print(f"{'configuration':<32} {'median s':>9} {'min s':>7} {'max s':>7}")
    print(f"{'with the dtcompile plugin':<32} {a:>9.3f} {min(with_plugin):>7.3f} {max(with_plugin):>7.3f}")
    print(f"{'-p no:dtcompile':<32} {b:>9.3f} {min(without):>7.3f} {max(without):>7.3f}")
    print(f"ratio with / without: {a / b:.3f}x ({args.runs} runs each, alternating)")


if __name__ == "__main__":
    main()
