"""One back half for the front doors: one place makes a ``CompiledGraph``, one check of ranks.

The Dynamo backend (``torch.compile(backend="dtcompile")``), ``dtcompile.compile_step`` and
graph_trainer's ``dtcompile`` pipeline (its pass is :class:`dtcompile.pipeline.step_pass.StepPass`) each
hand a graph to :func:`dtcompile.passes.run_passes`, describe what it made with
:func:`dtcompile.passes.compiled_graph` and have its ranks compare it through
:class:`dtcompile.ranks.check.RankChecker`.  Read from the code here, and driven on two
threaded ranks: every entry's check goes through that one class (issue #68).
"""

from __future__ import annotations

import ast
import threading

import pytest
import torch
from support.library import modules
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

import dtcompile
from dtcompile.ranks.check import RankChecker
from dtcompile.testing import run_threaded


def _calls(name: str, *, attributes: bool = True) -> dict[str, int]:
    """Library module -> how many calls of ``name`` it makes (``f(...)``, and ``x.f(...)``
    unless ``attributes`` is false)."""
    found = {}
    for module, path in modules().items():
        tree = ast.parse(path.read_text())
        n = sum(
            1
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and ((isinstance(node.func, ast.Name) and node.func.id == name)
                 or (attributes and isinstance(node.func, ast.Attribute) and node.func.attr == name))
        )
        if n:
            found[module] = n
    return found


def test_one_place_makes_a_compiled_graph():
    assert _calls("CompiledGraph") == {"dtcompile.passes": 1}
    # Both entries' back halves describe their graphs with it.
    assert set(_calls("compiled_graph")) == {"dtcompile.pipeline.graph_compile", "dtcompile.pipeline.step_pass"}


def test_one_check_of_ranks():
    # The exchange runs only inside RankChecker.check; the one checker of each entry is its
    # CompileLog's (a backend sharing another's records gets a checker of its own).
    assert _calls("agree", attributes=False) == {"dtcompile.ranks.check": 1}
    assert _calls("RankChecker") == {"dtcompile.pipeline.compile_log": 2}
    assert set(_calls("CompileLog")) == {"dtcompile.compiler", "dtcompile.pipeline.step_pass"}


_TRACING = threading.Lock()
_entry = threading.local()


def _each_entry_on_a_rank(rank: int) -> None:
    """One compile through each front door on this rank (``_entry.name`` says which)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dtcompile.pipeline.step_pass import StepPass
    from dtcompile.testing.worlds import wait_for_eager_on_every_rank

    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    for module in model:
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(0)]))
    x = torch.randn(4, 8)

    def gathered(inp):
        h = inp
        for module in model:
            if isinstance(module, nn.Linear):
                h = torch.nn.functional.linear(h, module.weight.full_tensor(), module.bias)
            else:
                h = module(h)
        return h.pow(2).mean()

    # graph_trainer's tracer hands its pass a make_fx graph of local tensors and functional collectives.
    group_name = mesh.get_group("dp").group_name

    def local_step(w0, w1, inp):
        full = [torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(w, 2, group_name))
                for w in (w0, w1)]
        return (torch.relu(inp @ full[0].t()) @ full[1].t()).sum()

    weights = [torch.randn(4, 8), torch.randn(4, 8)]
    with _TRACING:  # make_fx's patcher is one per process: the rank threads trace in turn
        gm = make_fx(local_step, tracing_mode="fake")(*weights, x)

    wait_for_eager_on_every_rank()
    _entry.name = "dynamo"
    torch.compile(gathered, backend=dtcompile.backend(inductor=False), fullgraph=True)(x).backward()
    _entry.name = "compile_step"
    dtcompile.compile_step(gathered, model=model, inductor=False)(x)
    _entry.name = "graph_trainer pass"
    StepPass({"inductor": False}, [mesh])(gm, [*weights, x])


@pytest.mark.slow
def test_every_front_door_checks_its_ranks_through_the_one_checker(monkeypatch):
    seen: list[tuple[int, str, str]] = []
    original = RankChecker.check

    def spy(self, schedule, groups, timeout_s, axes, **kwargs):
        seen.append((torch.distributed.get_rank(), _entry.name, schedule.compile_id))
        return original(self, schedule, groups, timeout_s, axes, **kwargs)

    monkeypatch.setattr(RankChecker, "check", spy)
    run_threaded(2, _each_entry_on_a_rank, timeout=240)
    for rank in range(2):
        mine = [(entry, compile_id) for r, entry, compile_id in seen if r == rank]
        assert {entry for entry, _ in mine} == {"dynamo", "compile_step", "graph_trainer pass"}, (rank, seen)
        assert ("graph_trainer pass", "step/0") in mine and ("compile_step", "step/0") in mine, (rank, seen)
