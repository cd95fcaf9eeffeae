"""The passes' work grows with the graph, not with its square (#70).

Counted as the lines of dtcompile's code that run inside the passes (``run_passes``, with
the simulations and memory estimates they call), on SimpleFSDP's ``NormMLPStack`` at 4 and
16 layers on the fake group: a count the machine's speed does not change.  A walk that
goes over the graph once per collective, per bucket or per window grows like the square of
the depth; its lines then grow far faster than the nodes.  Round 9 of
``benchmarks/RESULTS.md``'s compile_depth.py found three such walks this way (bucketing's
whole-graph numbering per bucket and its rewrite of the graph's output per bucket,
overlap's node-by-node sum of a window that does not cover its collective); this test
fails on each of them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import dtcompile
from dtcompile._testing.models import build_norm_mlp_stack
from dtcompile._testing.pass_work import counting_pass_work
from dtcompile.testing import fake_world

pytestmark = pytest.mark.slow


def _lines_in_passes(layers: int) -> tuple[int, Counter[tuple[str, str]]]:
    """The graphs' nodes, and the lines of dtcompile's code run inside the passes, by
    function, for one forward and backward of the stack at ``layers`` layers."""
    with fake_world(4, (4,), ("dp",)) as mesh, counting_pass_work("lines") as work:
        _, parallel, x = build_norm_mlp_stack(mesh, rows=4, dim=16, hidden=32, layers=layers)
        torch._dynamo.reset()
        out = torch.compile(parallel, backend=dtcompile.backend(inductor=False))(x.chunk(4)[0])
        out.sum().backward()
    return work.nodes, work.lines


def test_the_passes_lines_grow_with_the_nodes() -> None:
    small_nodes, small = _lines_in_passes(4)
    large_nodes, large = _lines_in_passes(16)
    growth = large_nodes / small_nodes
    assert 3.5 < growth < 4.5  # 4x the layers: about 4x the nodes
    total = sum(large.values()) / sum(small.values())
    assert total < 1.1 * growth, f"the passes' lines grew {total:.2f}x for {growth:.2f}x the nodes"
    # Each function that runs often: a log factor (the memory estimates' segment trees,
    # about 1.6x the nodes' growth here) passes, a walk over the graph per collective,
    # bucket or window does not.
    faster = {
        f"{Path(file).name}:{name}": round(count / max(small[file, name], 1), 2)
        for (file, name), count in large.items()
        if count >= 1000 and count / max(small[file, name], 1) > 1.75 * growth
    }
    assert not faster, f"lines that grew faster than the nodes ({growth:.2f}x): {faster}"
