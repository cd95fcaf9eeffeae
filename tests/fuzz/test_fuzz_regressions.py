"""The fuzzer's finds, shrunk and pinned: each program must run compiled as it runs eagerly.

Every test runs one shrunk program on threaded ranks, eager then compiled with
dtcompile (``inductor=False``, ``fullgraph=True``), and asserts the verdict is
``ok`` (see ``fuzz_check``).  A bug not yet fixed is ``xfail(strict=True,
raises=AssertionError)`` with whose it is and what happens, and its program
must fail the way it was found (``fails_as``), not some other way.  When a fix
makes one XPASS, drop its xfail and its entry in ``fuzz_known.KNOWN``.

Evidence for each find: ``fuzz_known.diagnose`` (which part of the compiler it
goes away without), the same program on 2 gloo processes
(``fuzz_world.run_on_gloo``), and for an eager bug, plain torch on the full
tensors.  Most finds were one family: when ranks hold local shards of
different shapes (an uneven ``Shard`` or ``_StridedShard``: one rank's shard
padded, another's empty), their graphs differ, and a decision made per rank
from its own graph -- which collectives to bucket, where to move them, what the
min-cut partitioner recomputes -- differed too; then the ranks issued
different collectives and waited for each other forever (on gloo as on threads).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from support.fuzz_known import check_program
from support.fuzz_programs import Input, program_from_text

# Each runs a world of threaded ranks (2 to 5 s): the slow tier's, with the batch.
pytestmark = pytest.mark.fuzz


def _passes(mesh: str, inputs: list[Input], text: str, *, fails_as: str = "", loss: tuple[tuple[str, str], ...] = ()) -> None:
    """The program (and its backward from ``loss``) runs compiled as eagerly (or both refuse
    it on every rank); while its bug
    stands, the assertion fails, and a failure other than ``fails_as`` (a regular expression
    for the verdict's signature) is an error that no xfail hides (they expect an AssertionError)."""
    verdict = check_program(program_from_text(mesh, inputs, text, loss=loss))
    if verdict.kind not in ("ok", "both_raise") and not re.search(fails_as, verdict.signature):
        raise RuntimeError(f"fails otherwise than pinned ({fails_as!r}): {verdict.signature}\n{verdict.detail[-3000:]}")
    assert verdict.kind in ("ok", "both_raise"), f"{verdict.signature}\n{verdict.detail[-3000:]}"


def test_linear_of_an_uneven_shard_with_itself():
    """Was a hang (3bcdd39): rank 0 (a 1x3 shard) bucketed the all-gathers of x0 and
    x0.T into one, rank 1 (an empty shard, padded first) did not."""
    _passes("1d2", [Input("x0", (1, 3), ("Shard(0)",), False, 1606)], """
t0 = torch.nn.functional.linear(x0, x0)
return t0
""", fails_as="^hang")


def test_cat_of_a_dim_sharded_on_both_axes():
    """Was a hang (3bcdd39): bucketing differed between the ranks of a 2x2 mesh."""
    _passes("2d", [Input("x1", (4, 2), ("Shard(1)", "Shard(1)"), False, 30)], """
t1 = torch.cat([x1, x1], 1)
return t1
""", fails_as="^hang")


def test_collectives_of_an_unused_value_moved_per_rank():
    """Was a hang (3bcdd39): ``t0`` is not returned but its collectives stay; overlap
    moved them by their estimated cost, which differed between the rank with a
    1-element shard of dim 1 and the rank with an empty one."""
    _passes("1d2", [
        Input("x0", (2, 1, 1), ("Shard(1)",), False, 4763),
        Input("x1", (2, 1, 1), ("Partial()",), False, 3016),
        Input("x2", (6, 3, 5), ("Partial()",), False, 1331),
    ], """
t0 = torch.maximum(x1, x0)
t1 = torch.maximum(x2, x2)
return t1
""", fails_as="^hang")


def test_matmul_of_a_strided_shard_with_its_transpose():
    """Was a hang (3bcdd39): _StridedShard(2, split_factor=2) of a dim of 2 over 2 ranks
    gives rank 0 the whole dim and rank 1 nothing; bucketing with overlap differed."""
    _passes("1d2", [Input("x0", (6, 5, 2), ("_StridedShard(2, split_factor=2)",), False, 3551)], """
t0 = x0.transpose(-1, -2) @ x0
return t0
""", fails_as="^hang")


def test_gather_along_a_dim_then_split():
    """Was BackendCompilerFailed (3bcdd39): async_tp's _skip_full_slice read
    ``.shape`` of a split's value, a list."""
    _passes("1d2", [Input("x0", (6, 4, 5), ("Replicate()",), False, 7564)], """
t0 = x0.redistribute(mesh, [Shard(1)])
t1 = t0.redistribute(mesh, [Shard(2)])
return t1
""", fails_as="'list' object has no attribute 'shape'")


def test_local_map_region_given_one_tensor_twice():
    """Was a graph break under fullgraph=True (8ee0a10): region operands must not alias."""
    _passes("1d2", [Input("x0", (4, 3), ("Shard(0)",), False, 0)], """
@dtcompile.local_map(out_placements=[Shard(0)], in_placements=([Shard(0)], [Shard(0)]))
def region_twice(a, b):
    return a * b + 1.0

t0 = region_twice(x0, x0)
return t0
""", fails_as="^graph_break: Unsupported: dtcompile: local_map region")


def test_view_of_an_input_returned():
    """Was stock torch's (8cf4b6e works around it): AOTAutograd regenerates an output
    that views an input with as_strided, which DTensor refuses (also with aot_eager,
    also without dtcompile's Dynamo support)."""
    _passes("1d2", [Input("x0", (6,), ("Replicate()",), False, 1302)], """
t0 = x0.unsqueeze(0)
return t0
""", fails_as="as_strided not supported with DTensor")


def test_permute_of_a_strided_shard():
    """Was stock torch's (8cf4b6e works around it): the compiled permute of a
    _StridedShard(0) input said _StridedShard(0), eager (rightly) _StridedShard(1)."""
    _passes("1d2", [Input("x1", (1, 1), ("_StridedShard(0, split_factor=2)",), False, 376)], """
t3 = x1.permute(1, 0)
return t3
""", fails_as="^mismatch: output placements")


def test_backward_through_an_uneven_strided_shard():
    """Was a hang (794a394): with Inductor's decompositions, the min-cut partitioner
    gave the rank holding an empty _StridedShard one all-gather more (stock torch's
    partitioner, as Inductor uses it; fine with either alone)."""
    _passes("1d2", [Input("x0", (3, 5, 2), ("_StridedShard(2, split_factor=2)",), True, 9998)], """
t1 = x0.redistribute(mesh, [Shard(1)])
t2 = x0.sum(2, keepdim=True)
return t2, t1
""", fails_as="^hang")


def test_local_map_region_given_a_partial_avg_tensor_twice():
    """Was a TorchRuntimeError (8ee0a10): the copy made for the region's second use of a
    tensor was a DTensor ``clone``, which came back Replicate, and redistributing it back
    to Partial('avg') is refused; the copy now keeps the placements."""
    _passes("1d2", [Input("x0", (6, 2, 1), ("Partial('avg')",), False, 842)], """
@dtcompile.local_map(out_placements=[Partial('avg')], in_placements=([Partial('avg')], [Partial('avg')]))
def region_twice(a, b):
    return a - torch.relu(b)

t0 = region_twice(x0, x0)
return t0
""", fails_as="RuntimeError when making fake tensor call")


def test_random_factory_on_a_cpu_mesh():
    """Was compiled where eager refuses (no RNG tracker on a CPU mesh), drawing from each
    rank's own generator; DTensor's random factories are now a graph break (an error
    under fullgraph=True), and they run as eager runs them."""
    _passes("1d2", [], """
t0 = dtensor.randn((1, 2), device_mesh=mesh, placements=[Shard(0)])
return t0
""", fails_as="^compiled_accepts: AssertionError")


def test_empty_share_of_a_gather_dropped_as_dead_code():
    """Was a hang: the rank whose share of a gathered result is empty (5 rows of a
    _StridedShard over 4 ranks) computes it as full([0, 3]); the default partitioner's
    dead-code pass removed its then unused all-gather, the other ranks waited in theirs.
    dtcompile's partitioner keeps every traced collective in its phase's graph."""
    _passes("1d4", [Input("x0", (5, 3), ("_StridedShard(0, split_factor=2)",), True, 2053)], """
t0 = x0.redistribute(mesh, [Shard(0)])
return t0
""", fails_as="^hang")


def test_forward_reduce_scatter_recomputed_in_one_ranks_backward():
    """Was a hang (found by the 500 batch): on the rank whose share of x0's uneven
    reduce-scatter (a dim of 1 over 4) is empty, the default partitioner recomputed the
    forward's reduce-scatter in the backward instead of saving its result; the other
    ranks' backwards issue no such collective.  Forward collectives stay in the forward."""
    _passes("2d", [
        Input("x0", (1, 4, 4), ("Partial()", "Partial()"), True, 0),
        Input("x1", (6,), ("_StridedShard(0, split_factor=2)", "Shard(0)"), True, 1144),
        Input("x2", (2, 2), ("_StridedShard(1, split_factor=2)", "Shard(1)"), True, 131),
    ], """
t0 = x2.redistribute(mesh, [Replicate(), Shard(0)])
t1 = x0.redistribute(mesh, [Shard(0), Shard(0)])
t2 = torch.bmm(x0, t1)
return t0, t2
""", fails_as="^hang", loss=(("t0", "to_local"), ("t2", "to_local")))


def test_backward_of_a_strided_shard_gathered_to_one_row():
    """Was a hang, as above: with a backward, the empty-share rank's forward also held a
    (dead) copy of the backward's all-gather, which the other ranks issue in the backward."""
    _passes("1d2", [Input("x1", (1, 4), ("_StridedShard(1, split_factor=2)",), True, 363)], """
t0 = x1.redistribute(mesh, [Shard(0)])
return t0
""", fails_as="^hang", loss=(("t0", "full_tensor"),))


def test_narrow_of_a_sharded_dim_returned():
    """Was stock torch's (as_strided on a DTensor): the narrow gathers first, so the
    output shares no storage with the input, but AOTAutograd still regenerates it as
    the input's view; an output made from an input by view ops alone is now made by
    those ops on the real input after the compiled call."""
    _passes("2d", [Input("x0", (5, 5), ("Replicate()", "Shard(0)"), False, 1136)], """
t3 = x0.narrow(0, 3, 1)
return t3
""", fails_as="as_strided not supported with DTensor")


def test_chunk_of_a_shard_that_requires_grad():
    """Was stock torch's (below): a returned chunk of an input is now made by the
    chunk on the real input after the compiled call, as eager makes it."""
    _passes("1d2", [Input("x0", (4, 6), ("Shard(0)",), True, 3264)], """
t0 = x0.chunk(2, 0)[0]
return t0
""", fails_as="aten.cat.default got mixed torch.Tensor and DTensor")


def test_chunk_of_a_shard_that_requires_grad_used_in_the_graph():
    """Was stock torch's (20 programs of each run of 5000): the traced backward of
    ``split`` cats the DTensor gradient with plain zeros for the unused chunk (also
    with aot_eager without dtcompile's Dynamo support).  Now run eagerly (below)."""
    _passes("1d2", [Input("x0", (4, 6), ("Shard(0)",), True, 3264)], """
t0 = x0.chunk(2, 0)[0] * 2.0
return t0
""", fails_as="aten.cat.default got mixed torch.Tensor and DTensor")


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="torch eager DTensor: amax over a dim of 2 held by a _StridedShard that leaves rank 1 an "
    "empty shard raises on rank 1 only (reduction over a zero-size dim); rank 0 runs on",
)
def test_eager_amax_over_an_empty_shard():
    _passes("1d2", [Input("x1", (2,), ("_StridedShard(0, split_factor=2)",), False, 681)], """
t3 = x1.amax(-1)
return t3
""", fails_as="^hang: (eager ranks disagree|some ranks raised in eager)")


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="torch eager DTensor: vector @ matrix and linear(vector, W) have shape (1, n), "
    "torch's (and compiled code's) is (n,); the fuzzer draws no 1-D DTensor times a matrix",
)
def test_eager_vector_times_matrix_shape(fake_world):
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = fake_world(2)
    v, w = torch.randn(2), torch.randn(2, 3)
    dv, dw = distribute_tensor(v, mesh, [Replicate()]), distribute_tensor(w, mesh, [Replicate()])
    dw_t = distribute_tensor(w.t().contiguous(), mesh, [Replicate()])
    assert (dv @ dw).shape == (v @ w).shape == (3,)
    assert F.linear(dv, dw_t).shape == F.linear(v, w.t()).shape == (3,)


def test_local_map_region_given_a_partial_tensor_twice_with_a_backward():
    """Was a mismatch (found by the run of 5000, seed 1): the copy made for the second use
    of a tensor went through ``to_local``/``from_local``, whose backward made its
    ``Partial`` gradient ``Replicate`` (an all-reduce): the same sum, other per-rank
    values than eager's.  The copy's gradient now passes through in the declared
    ``in_grad_placements``."""
    _passes("1d2", [Input("x1", (5, 4), ("Partial()",), True, 546)], """
@dtcompile.local_map(out_placements=[Partial()], in_placements=([Partial()], [Partial()]))
def region_t0(a, b):
    return a * b + 1.0

t0 = region_t0(x1, x1)
return t0
""", fails_as="^mismatch: grad values", loss=(("t0", "full_tensor"),))


def test_contiguous_of_a_narrow_of_a_sharded_dim_returned():
    """Was an internal error (the run of 5000): as ``test_narrow_of_a_sharded_dim_returned``
    with a ``contiguous()`` after the narrow; AOTAutograd regenerated the output with
    ``as_strided``.  ``contiguous`` is among the ops an output is remade with."""
    _passes("1d2", [Input("x2", (6,), ("Shard(0)",), False, 3486)], """
t0 = x2.narrow(0, 3, 3)
t1 = t0.contiguous()
return t1
""", fails_as="as_strided not supported with DTensor")


def test_dead_copy_of_a_backward_collective_in_one_ranks_forward():
    """Was a hang (the run of 5000): on the ranks whose share of x0 is empty, a backward
    all-gather needs no gradient, so the default partitioner copied it (and the ops
    around it) into the forward, dead; its dead-code pass keeps every node but a
    collective, so the copy stayed, and those ranks issued one all-gather more in the
    forward than rank 0.  Dead copies outside their traced phase now go."""
    _passes("2d", [Input("x0", (5, 1), ("_StridedShard(1, split_factor=2)", "Shard(1)"), True, 1824)], """
t0 = x0.redistribute(mesh, [Shard(1), Shard(0)])
t1 = x0.narrow(1, 0, 1)
return t0, t1
""", fails_as="^hang", loss=(("t0", "to_local"), ("t1", "to_local")))


def test_matmul_and_redistribute_of_an_uneven_2d_shard():
    """Was a hang (the run of 5000): some ranks raised in the compiled backward (a
    broadcast shape error) while the others waited in a collective."""
    _passes("2d", [Input("x0", (2, 1, 1), ("Shard(0)", "Shard(0)"), True, 1695)], """
t0 = x0.unsqueeze(3)
t1 = t0.redistribute(mesh, [Shard(3), Shard(3)])
t2 = x0 @ x0.transpose(-1, -2)
return t1, t2
""", fails_as="^hang", loss=(("t1", "full_tensor"), ("t2", "full_tensor")))


def test_bucketed_gathers_read_by_a_view():
    """Was an internal error (the run of 5000): bucketing merged the all-gathers of x0 and
    x1; each member's result, a column of the bucket's ``[ranks, total]`` output, was not
    contiguous where the collective's own output was, and the ``view`` DTensor reads the
    gathered ``_StridedShard`` with failed.  Gathered members are made contiguous."""
    _passes("1d2", [
        Input("x0", (1, 1, 4), ("Shard(2)",), True, 388),
        Input("x1", (1, 1, 4), ("_StridedShard(2, split_factor=2)",), True, 1276),
    ], """
t0 = x0.full_tensor()
t2 = x1.full_tensor()
return t0, t2
""", fails_as="view size is not compatible")


def test_detached_select_of_a_sharded_dim_returned():
    """Was an internal error (the second run of 5000): as the narrow above, with
    ``select`` and a ``detach()``; ``detach`` joins the ops an output is remade with."""
    _passes("1d2", [Input("x0", (4, 2, 3), ("Shard(0)",), True, 8)], """
t0 = x0.select(0, 0)
return t0
""", fails_as="as_strided not supported with DTensor", loss=(("t0", "full_tensor"),))


# Stock torch's AOTAutograd refuses these programs, which eager DTensor runs (found by
# the runs of 5000, culprit "AOTAutograd": the Dynamo graph run as it is passes,
# aot_eager fails).  The backend now runs such a graph eagerly, with a warning
# (``eager_fallback``; see tests/backend/test_eager_fallback.py).

def test_norm_of_a_partial_tensor_that_requires_grad():
    """Was an internal error: the traced backward of ``norm`` runs an in-place
    ``masked_fill_`` on the ``Partial`` gradient, which DTensor refuses."""
    _passes("1d2", [Input("x1", (1,), ("Partial()",), True, 1213)], """
t3 = x1.norm()
return t3
""", fails_as="masked_fill_")


def test_view_of_a_dim_sharded_over_both_axes():
    """Was an internal error: redistributed to ``(Shard(1), Shard(1))``, then flattened;
    AOTAutograd's replay views a ``_StridedShard``, which DTensor refuses."""
    _passes("2d", [Input("x1", (5, 4), ("Replicate()", "Replicate()"), True, 424)], """
t0 = x1.redistribute(mesh, [Shard(1), Shard(1)])
t1 = t0.view(20)
return t1
""", fails_as="remove or reshape sharded dimension")


def test_two_returned_views_of_one_result():
    """Was an internal error: AOTAutograd refuses outputs that alias one another
    when any output is a tensor subclass."""
    _passes("1d2", [Input("x0", (3, 1, 4), ("Replicate()",), True, 51)], """
t0 = x0 + x0
t1 = t0.squeeze(1)
t2 = t0.permute(2, 1, 0)
return t1, t2
""", fails_as="outputs\\s+that alias|tensor subclass inputs")


def test_mm_of_a_partial_sum_and_a_partial_max_that_requires_grad():
    """Was an internal error: the traced backward redistributes ``P(sum)`` to ``P(max)``."""
    _passes("1d2", [
        Input("x0", (2, 2), ("Partial()",), False, 803),
        Input("x1", (2, 2), ("Partial('max')",), True, 2936),
    ], """
t0 = x1.redistribute(mesh, [Replicate()], async_op=True)
t4 = torch.mm(x0, t0)
return t4
""", fails_as="P\\(sum\\)\\) to another \\(P\\(max\\)")


def test_logsumexp_of_an_unflatten_sharded_unevenly():
    """Was an internal error: the backward views the unflattened dims back into one,
    which DTensor refuses for a dim sharded unevenly."""
    _passes("2d", [Input("x0", (6, 6, 5), ("Partial()", "Shard(0)"), True, 7369)], """
t0 = x0.unflatten(1, (3, 2))
t5 = torch.logsumexp(t0, -3)
return t5
""", fails_as="Cannot flatten unevenly sharded")


def test_elementwise_backward_of_a_partial_max_tensor():
    """Was an internal error: the compiled backward reduce-scatters with max, which torch's
    threaded group did not support (NotImplementedError; gloo does); eager refused the same
    in 136 other programs.  ``run_threaded``'s group now reduce-scatters with every reduction."""
    _passes("2d", [
        Input("x0", (2, 6), ("Partial('max')", "Shard(1)"), True, 1570),
        Input("x1", (1, 6), ("Shard(1)", "Shard(1)"), False, 25),
    ], """
t0 = torch.relu(x0)
t1 = torch.relu(x0)
t2 = torch.sigmoid(x0)
t3 = torch.tanh(t0)
t4 = torch.tanh(t1)
return t2, t3, t4
""", fails_as="ReduceScatter does not support")
