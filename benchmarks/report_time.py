"""How long the inspection reports take for the tensor + sequence parallel block.

Traces one training step of the block (dim 256, 8 heads, hidden 1024, batch 4,
seq 128; fake PG, world 4; dtcompile with Inductor) with ``TORCH_TRACE`` in a
fresh process, then times, median of ``--repeats``:

- ``dtcompile-report``: reading the trace directory and writing the HTML;
- the text report: ``str(report)`` of the ``dtcompile.explain`` result of the
  same step (formatting only; the compile is not timed).

    python benchmarks/report_time.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_TRACE = textwrap.dedent(
    """
    import torch, dtcompile
    from dtcompile._testing.cases import CASES, run_step
    from dtcompile._testing.models import BlockArgs, build_block
    from dtcompile.testing import fake_world
    with fake_world(4, (4,), ("tp",)) as mesh:
        _, parallel, x = build_block(mesh, batch=4, seq=128, args=BlockArgs(dim=256, n_heads=8, hidden=1024))
        run_step(torch.compile(parallel, backend="dtcompile"), parallel, x)
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch

    import dtcompile
    from dtcompile._testing.models import BlockArgs, build_block
    from dtcompile.testing import fake_world
    from dtcompile_tools import report as report_tool

    with tempfile.TemporaryDirectory() as trace_dir, tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "TORCH_TRACE": trace_dir}
        subprocess.run([sys.executable, "-c", _TRACE], env=env, check=True, capture_output=True)
        size = sum(p.stat().st_size for p in Path(trace_dir).iterdir())
        html_times = []
        for _ in range(opts.repeats):
            start = time.perf_counter()
            report_tool.main([trace_dir, "-o", out])
            html_times.append(time.perf_counter() - start)
        page = (Path(out) / "index.html").stat().st_size
    with fake_world(4, (4,), ("tp",)) as mesh:
        _, parallel, x = build_block(mesh, batch=4, seq=128, args=BlockArgs(dim=256, n_heads=8, hidden=1024))
        report = dtcompile.explain(parallel)(x)
        text_times = []
        for _ in range(opts.repeats):
            start = time.perf_counter()
            text = str(report)
            text_times.append(time.perf_counter() - start)
    torch._dynamo.reset()
    print(f"block model, median of {opts.repeats}")
    print(f"{'report':<28} {'seconds':>8} {'input':>14} {'output':>12}")
    print(f"{'dtcompile-report (HTML)':<28} {statistics.median(html_times):>8.3f} {f'{size} B trace':>14} {f'{page} B':>12}")
    print(f"{'str(explain(...)) (text)':<28} {statistics.median(text_times):>8.3f} {'':>14} {f'{len(text)} chars':>12}")


if __name__ == "__main__":
    main()
