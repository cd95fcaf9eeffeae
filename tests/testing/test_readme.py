"""The README's quick start runs as written: extracted from README.md, run in a fresh
interpreter on 4 ranks as threads, with Inductor (``backend="dtcompile"``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.subprocess
@pytest.mark.inductor
def test_the_readme_quick_start_runs_and_prints_what_the_readme_says(tmp_path):
    (program,) = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.MULTILINE | re.DOTALL)
    (tmp_path / "quick_start.py").write_text(program)
    out = subprocess.run([sys.executable, "quick_start.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    # What the README shows of the output: rank 0's report, its one all-reduce on tp.
    shown = re.search(r"^```text\n(.*?)^```$", README.read_text(), flags=re.MULTILINE | re.DOTALL).group(1)
    collective = shown.strip().splitlines()[-1].split(maxsplit=1)[1]  # without the compile id
    assert "== collectives ==" in out.stdout and collective in out.stdout, out.stdout[-3000:]
    assert out.stdout.count("dtcompile report;") == 1, "only rank 0 prints its report"
    # explain on threaded ranks leaves Dynamo's shared caches alone (resetting them freed the code
    # other ranks ran: a crash), and does not count the process's graph breaks as one rank's.
    assert "== recompiles ==\n- not counted: the ranks are threads of one process" in out.stdout
