"""Progress on long work: a bar on a terminal, log lines otherwise, for auto-parallel and the report."""

from __future__ import annotations

import logging

import pytest
from torch.distributed.tensor import Replicate

import dtcompile
from dtcompile._testing.models import build_mlp
from dtcompile.base import progress as progress_module
from dtcompile.base.progress import Progress, track

LOGGER = "dtcompile.progress"


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_without_a_terminal_a_line_every_tenth_and_at_the_end(caplog, monkeypatch):
    monkeypatch.setattr(progress_module, "_terminal", lambda: False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert list(track(range(95), "counting", unit="number")) == list(range(95))
    lines = _lines(caplog)
    assert [line.split(",")[0] for line in lines[:-1]] == [f"counting: {n}/95 numbers" for n in (10, 19, 29, 38, 48, 57, 67, 76, 86, 95)]
    assert lines[-1].startswith("counting: done, 95 numbers in ")


def test_on_a_terminal_a_bar_and_no_lines_but_the_last(caplog, capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "_terminal", lambda: True)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with Progress("planning", 3) as progress:
        for stage in ("traced", "built", "solved"):
            progress.step(stage)
    drawn = capsys.readouterr().err
    assert "planning" in drawn and "3/3" in drawn and "solved" in drawn
    assert [line.split(",")[0] for line in _lines(caplog)] == ["planning: done"]


def test_a_rank_that_does_not_show_says_nothing(caplog, capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "_terminal", lambda: True)
    caplog.set_level(logging.INFO, logger=LOGGER)
    with Progress("calibrating", 2, show=False) as progress:
        progress.step()
        progress.step()
    assert progress.done == 2
    assert capsys.readouterr().err == "" and _lines(caplog) == []


def test_auto_parallel_reports_its_stages(tp_mesh, caplog, monkeypatch):
    monkeypatch.setattr(progress_module, "_terminal", lambda: False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    reference, _, x = build_mlp(tp_mesh)
    dtcompile.auto_parallel.plan(reference, tp_mesh, (x,), input_placements=[(Replicate(),)])
    lines = _lines(caplog)
    stages = [line.split(" (")[1].split(")")[0] for line in lines if line.startswith("auto_parallel: ") and "/4 stages" in line]
    assert stages == ["traced", "problem built", "layers tied", "solved"]
    nodes = [line for line in lines if line.startswith("auto_parallel: candidate placements: done, ")]
    assert len(nodes) == 1 and int(nodes[0].split(", ")[1].split(" ")[0]) > 5


@pytest.mark.parametrize("logs", [1, 3])
def test_the_report_counts_the_logs_it_reads(tmp_path, caplog, monkeypatch, logs):
    from dtcompile_tools import report as report_tool

    monkeypatch.setattr(progress_module, "_terminal", lambda: False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    line = 'V1126 15:00:00.000000 1 torch/_logging/structured.py:1] {"artifact": {"name": "other", "encoding": "string"}}\n'
    for rank in range(logs):
        (tmp_path / f"dedicated_log_torch_trace_rank_{rank}_x.log").write_text(line)
    assert sorted(report_tool.read_trace(tmp_path).ranks) == list(range(logs))
    assert [m.split(",")[0] for m in _lines(caplog) if "done" in m] == ["dtcompile-report: reading logs: done"]
    assert f"done, {logs} logs in " in _lines(caplog)[-1]
