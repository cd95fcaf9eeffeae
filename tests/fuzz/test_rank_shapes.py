"""The per-rank-shapes fuzzer (issue #66): the shared models fed batches of each rank's own size.

Ranks of a data-parallel job legitimately see batches of their own sizes: a batch
padded to its own longest sequence, packed sequences, a short last batch.  Each case
(``support.rank_shapes_fuzz``) is one of the shared models on 2 gloo ranks (SimpleFSDP,
the FSDP MLP, the TP + SP block, the MoE) through one entry (``torch.compile`` with
``dtcompile.backend(inductor=False)``, or ``dtcompile.compile_step`` with AdamW
inside), every pass on, 2 to 4 steps, each data-parallel coordinate fed a size drawn
for it at every step (tensor-parallel peers share theirs).  Every case must run as
stock eager does, equal to it (1e-5), its ranks' collectives pairing
(``support.rank_shapes_run``); and the passes must still rewrite: some cases bucket.

The CI batch is :data:`CI_CASES` cases from a fixed seed (about a minute on 2 cores);
``--fuzz-examples N --fuzz-seed S`` runs more or others.  FSDP x TP (4 ranks) and the
1,000-program run are ``benchmarks/rank_shapes_fuzz.py``'s (``benchmarks/RESULTS.md``);
what they found is kept below.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from support.rank_shapes_fuzz import Case, draw_cases
from support.rank_shapes_report import format_report
from support.rank_shapes_run import run_cases

pytestmark = [pytest.mark.fuzz, pytest.mark.gloo]

CI_CASES = 14
CI_SEED = 20261201
CI_FAMILIES = ("simple_fsdp", "fsdp_mlp", "tp_sp", "moe")
"""The 2-rank families; FSDP x TP's 4 processes on CI's 2 cores are the benchmark's."""


def test_ranks_fed_batches_of_their_own_sizes_run_as_eager(fuzz_options, fuzz_report):
    examples, seed = fuzz_options
    seed = CI_SEED if seed is None else seed
    cases = draw_cases(CI_CASES if examples is None else examples, seed, families=CI_FAMILIES)
    start = time.perf_counter()
    results = run_cases(cases)
    report = format_report(results, time.perf_counter() - start, seed)
    fuzz_report(report)
    # The draw feeds the ranks sizes of their own, through both entries.
    assert sum(not case.equal for case in cases) >= len(cases) // 3, [c.describe() for c in cases]
    assert {case.entry for case in cases} == {"dynamo", "step"}, [c.describe() for c in cases]
    failed = [f"{r.case.describe()}: {r.outcome}: {r.detail[:800]} {r.note}" for r in results if r.outcome != "ok"]
    assert not failed, "\n".join(failed) + "\n\n" + report
    # Still bucketed, on every rank alike, with sizes of their own too.
    assert sum(r.bucketed for r in results if not r.case.equal) >= 2, report


# The finds, kept (benchmarks/RESULTS.md, "rank_shapes_fuzz.py").

FSDP_TP_RECOMPILE_ON_ONE_DP_COORDINATE = Case(
    index=0,
    family="fsdp_tp",
    entry="dynamo",
    sizes=(((1, 2), (1, 2)), ((1, 4), (1, 2))),
    pattern="one_differs",
    dims=(("dim", 16), ("n_heads", 2), ("hidden", 32)),
    seed=1,
    check_ranks=False,
)
"""FSDP x TP on 2 x 2: at the second step dp coordinate 0 gets 4 tokens, coordinate 1 its 2 again.
Ranks 0 and 1 recompile (dynamic).  Their tensor-parallel shards of the sequence, ``2 * s0``
long, were judged uneven ("symbolic size"), so bucketing did not run in that graph and the
partitioner kept the gathers in the forward: 9 unbucketed dp gathers where ranks 2 and 3, which
did not recompile, issue 2 buckets (800 and 512 floats).  gloo aborted rank 0 ("Received data
size doesn't match expected size. 800 vs 16"); with the ranks' check on, ranks 0 and 1 waited
for dp peers that never recompile.  A symbolic size known to divide is even now
(:func:`dtcompile.graph.rank_dependence.uneven_sharding`)."""


@pytest.mark.parametrize("check_ranks", [False, True], ids=["check_off", "check_on"])
def test_fsdp_tp_recompiling_on_one_dp_coordinate_keeps_its_dp_collectives(check_ranks):
    (result,) = run_cases([dataclasses.replace(FSDP_TP_RECOMPILE_ON_ONE_DP_COORDINATE, check_ranks=check_ranks)])
    assert result.outcome == "ok", f"{result.outcome}: {result.detail[:1500]} {result.note}"


SIMPLE_FSDP_ONE_ROW_ON_ONE_RANK = Case(
    index=0,
    family="simple_fsdp",
    entry="dynamo",
    sizes=(((3,), (4,)), ((2,), (3,)), ((1,), (2,))),
    pattern="independent",
    dims=(("dim", 8), ("hidden", 16), ("layers", 2)),
    seed=36479,
    check_ranks=False,
)
"""SimpleFSDP (2 x LayerNorm, Linear 8->16, GELU, Linear 16->8) on 2 ranks; at the third step rank
0 gets 1 row, rank 1 2 rows (the 1,000-program run's programs 142, 175 and 545).  Rank 0
recompiles, specialized to 1 row (Dynamo's 0/1 rule), and the min-cut partitioner, pricing that
graph's own sizes, recomputes the LayerNorm's output in the backward where at 2 rows it saves it:
the up-projection's weight gradient then needs the LayerNorm weight, so its re-gather
(``reshard_after_forward``) goes before that gradient's reduce-scatter, where rank 1's dynamic
graph sends the reduce-scatter first.  The traced collectives' order is the same on both ranks
with ``reshard_after_forward=False``; no order of the collectives was legal on both graphs (an
attempt to issue them module by module, as FSDP2 does, found rank 0's dependencies forbid it).
gloo aborted (check off); with the check on, rank 0 waited for rank 1, which ran its earlier graph,
and stopped with RanksDisagree after check_ranks_timeout_s.  The first ops computing with a
resharded weight are now saved for the backward, never recomputed
(:func:`dtcompile.pipeline.reshard.tag_reshard_after_forward`)."""


def test_simple_fsdp_with_one_row_on_one_rank_issues_its_peers_collectives():
    (result,) = run_cases([SIMPLE_FSDP_ONE_ROW_ON_ONE_RANK])
    assert result.outcome == "ok", f"{result.outcome}: {result.detail[:1500]} {result.note}"
