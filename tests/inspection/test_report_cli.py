"""dtcompile-report on traces users bring: cut off by a killed job, from another backend, a bad -o."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dtcompile.base.channels import Artifact, BesideCacheFolders, GraphKind
from dtcompile_tools import report as report_tool

# Each trace comes from a fresh interpreter with TORCH_TRACE set.
pytestmark = pytest.mark.subprocess

_BACKWARD_COLLECTIVES = Artifact.collectives(GraphKind.BACKWARD)

_PROGRAM = textwrap.dedent(
    """
    import sys, torch, dtcompile
    from dtcompile._testing.cases import CASES
    from dtcompile.testing import fake_world
    with fake_world(4, (4,), ("tp",)) as mesh:
        _, parallel, x = CASES["tp_mlp"].build(mesh)
        backend = {
            "dtcompile": lambda: dtcompile.backend(inductor=False),
            "dtcompile_inductor": lambda: dtcompile.backend(),
        }.get(sys.argv[1], lambda: sys.argv[1])()
        torch.compile(parallel, backend=backend)(x).sum().backward()
    """
)


# Two outputs that view one result: stock AOTAutograd refuses it for DTensor outputs,
# so the graph runs eagerly and only its dtcompile_eager_fallback artifact is logged.
_FALLBACK_PROGRAM = textwrap.dedent(
    """
    import torch, dtcompile
    from torch.distributed.tensor import DTensor, Replicate
    from dtcompile.testing import fake_world
    with fake_world(2) as mesh:
        x = DTensor.from_local(torch.ones(3, 1, 4), mesh, [Replicate()]).requires_grad_()
        f = lambda x: ((y := x * x).squeeze(1), y.permute(2, 1, 0))
        torch.compile(f, backend=dtcompile.backend(inductor=False))(x)
    """
)


def _trace(directory: Path, backend: str, program: str = _PROGRAM, cache: Path | None = None) -> Path:
    env = {**os.environ, "TORCH_TRACE": str(directory)}
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    out = subprocess.run(
        [sys.executable, "-c", program, backend], env=env, check=False, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return directory


@pytest.fixture(scope="module")
def dtcompile_trace(tmp_path_factory) -> Path:
    """The TP MLP compiled with dtcompile (no Inductor), forward and backward."""
    return _trace(tmp_path_factory.mktemp("dtcompile_trace"), "dtcompile")


@pytest.fixture(scope="module")
def stock_trace(tmp_path_factory) -> Path:
    """The same program compiled with stock aot_eager: no dtcompile artifacts."""
    return _trace(tmp_path_factory.mktemp("stock_trace"), "aot_eager")


def _cut(log: Path, into: Path, where: str) -> tuple[Path, int]:
    """``log`` copied into ``into``, cut inside its dtcompile_backward_collectives entry as a
    killed job leaves it; returns the copy and that entry's line number."""
    lines = log.read_text().split("\n")
    number = next(i for i, line in enumerate(lines, start=1) if f'"{_BACKWARD_COLLECTIVES}"' in line)
    kept = "\n".join(lines[: number - 1]) + "\n"
    metadata, payload = lines[number - 1], lines[number]
    assert payload.startswith('\t{"compile_id": "0/0", "kind": "backward"')
    kept += {
        "in its metadata line": metadata[: len(metadata) // 2],
        "after its metadata line": metadata + "\n",
        "in its payload": metadata + "\n" + payload[: len(payload) // 2],
    }[where]
    into.mkdir()
    cut = into / log.name
    cut.write_text(kept)
    return cut, number


@pytest.mark.parametrize("where", ["in its metadata line", "after its metadata line", "in its payload"])
def test_report_of_a_trace_cut_off_mid_entry(dtcompile_trace, tmp_path, capsys, where):
    (log,) = dtcompile_trace.glob("dedicated_log_torch_trace_rank_0_*.log")
    cut, number = _cut(log, tmp_path / "cut", where)
    assert report_tool.main([str(cut.parent), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    expected = {
        "in its metadata line": f"{cut}:{number}: the log ends in the middle of this line (was the program killed?); left it out",
        "after its metadata line": f"{cut}:{number}: the log ends inside this entry's payload "
        f"(artifact {_BACKWARD_COLLECTIVES}; was the program killed?); left the entry out",
        "in its payload": f"{cut}:{number}: the log ends inside this entry's payload "
        f"(artifact {_BACKWARD_COLLECTIVES}; was the program killed?); left the entry out",
    }[where]
    assert err == f"dtcompile-report: warning: {expected}\n"
    page = (tmp_path / "out" / "index.html").read_text()
    # What came before the cut is there: the forward all-reduce and the backward graph.
    assert '<td>forward</td><td>all_reduce</td><td>tp</td>' in page
    assert "<h3>backward graph</h3>" in page
    assert '<p class="profile">Priced with cost profile <b>h100</b> (auto: cpu tensors on ' in page
    assert f'<section id="warnings"><h2>Left out of this report</h2><ul>\n<li class="bad">{html.escape(expected)}</li>' in page


def test_report_out_must_be_a_directory(dtcompile_trace, tmp_path, capsys):
    existing = tmp_path / "report.html"
    existing.write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        report_tool.main([str(dtcompile_trace), "-o", str(existing)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: dtcompile-report")
    assert err.endswith(
        f"dtcompile-report: error: -o {existing}: is a file; -o names the directory that index.html "
        "is written into: pass a directory (it is created if missing)\n"
    )
    assert existing.read_text() == "mine"


def test_the_report_has_a_compile_seconds_table_per_compile(dtcompile_trace):
    """Each graph's stages as its last dtcompile_<kind>_compile_seconds logged them (no Inductor here)."""
    trace = report_tool.read_trace(dtcompile_trace)
    seconds = trace.ranks[0].compiles["0/0"].seconds
    assert sorted(seconds) == ["backward", "forward"]
    assert list(seconds["forward"]["stages"]) == ["Dynamo", "AOTAutograd", "partitioner", "passes", "simulations", "artifacts"]
    assert seconds["forward"]["total"] == pytest.approx(sum(seconds["forward"]["stages"].values()), abs=1e-5)
    page = report_tool.render_html(trace)
    table = page[page.index("<h3>Compile seconds</h3>") :].split("</table>")[0]
    header = [cell.split(">")[-1] for cell in table.split("</th>")[:-1]]
    assert header == ["graph", "Dynamo", "AOTAutograd", "partitioner", "passes", "simulations", "artifacts", "total"]
    assert "<td>forward</td>" in table and "<td>backward</td>" in table
    assert f'<td class="n">{seconds["forward"]["total"]:.3f}</td></tr>' in table


def test_report_refuses_a_trace_without_dtcompile_artifacts(stock_trace, tmp_path, capsys):
    assert list(stock_trace.glob("dedicated_log_torch_trace_rank_0_*.log"))
    out = tmp_path / "out"
    assert report_tool.main([str(stock_trace), "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"dtcompile-report: {stock_trace}: no dtcompile artifacts ({Artifact.PLACEMENTS}, "
        f"{Artifact.graph(GraphKind.FORWARD)}, {Artifact.collectives(GraphKind.FORWARD)}, "
        f"{Artifact.AUTO_PARALLEL_SOLUTION}, {Artifact.EAGER_FALLBACK}, {Artifact.CACHED_COMPILE}...) "
        "in the trace: the program was not "
        'compiled with dtcompile; compile it with torch.compile(..., backend="dtcompile") '
        "and run it again with TORCH_TRACE set\n"
    )
    assert not out.exists()


def test_report_shows_graphs_run_eagerly(tmp_path, capsys):
    trace = _trace(tmp_path / "trace", "dtcompile", _FALLBACK_PROGRAM)
    out = tmp_path / "out"
    assert report_tool.main([str(trace), "-o", str(out)]) == 0
    page = (out / "index.html").read_text()
    section = page[page.index('<section id="eager-fallbacks">') :].split("</section>")[0]
    assert "Graphs run eagerly (not compiled)" in section
    assert html.escape("compile 0/0: torch's AOTAutograd could not trace this graph over DTensor") in section
    assert "tensor subclass inputs" in section and "permute" in section


def _sections(page: str) -> dict[str, str]:
    return dict(re.findall(r'<section[^>]* id="([^"]+)">(.*?)</section>', page, flags=re.S))


@pytest.mark.inductor
def test_a_warm_cache_run_reports_what_a_cold_one_does(tmp_path):
    """A restarted run's graphs come from AOTAutograd's cache: nothing is traced, so the
    sections the run that compiled them kept beside the cache are logged again, and the
    report is the cold run's, plus a section saying which graphs the cache served, less
    the cold run's compile seconds (nothing was compiled again)."""
    cache = tmp_path / "cache"
    first = _trace(tmp_path / "first", "dtcompile_inductor", cache=cache)
    again = _trace(tmp_path / "again", "dtcompile_inductor", cache=cache)
    pages = {}
    for trace in (first, again):
        out = trace / "report"
        assert report_tool.main([str(trace), "-o", str(out)]) == 0
        pages[trace] = (out / "index.html").read_text()
    cold, warm = _sections(pages[first]), _sections(pages[again])
    assert "cached-compiles" not in cold and "compile-0_0" in cold
    seconds = re.compile(r"<h3>Compile seconds</h3><table>.*?</table>\n?", flags=re.S)
    assert seconds.search(cold["compile-0_0"]) and not seconds.search(warm["compile-0_0"])
    cold["compile-0_0"] = seconds.sub("", cold["compile-0_0"])
    served = warm.pop("cached-compiles")
    assert html.escape("compile 0/0: loaded from AOTAutograd's cache") in served
    assert "its report sections, kept beside the cache, are logged again" in served
    assert warm == cold
    assert '<svg class="timeline"' in warm["compile-0_0"] and '<svg class="memory"' in warm["compile-0_0"]
    # Without what was kept, the report says so instead of showing nothing.
    shutil.rmtree(cache / BesideCacheFolders.REPORTS)
    bare = _trace(tmp_path / "bare", "dtcompile_inductor", cache=cache)
    assert report_tool.main([str(bare), "-o", str(bare / "report")]) == 0
    sections = _sections((bare / "report" / "index.html").read_text())
    assert "compile-0_0" not in sections
    assert "what was kept of them beside the cache is gone" in sections["cached-compiles"]
