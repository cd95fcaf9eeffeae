"""What a compiled graph keeps for its SPMD-type re-check (``dtcompile.spmd.carry``), in host memory.

A graph whose inputs carry ``spmd_types`` types keeps a copy of its forward AOT graph as
traced (``traced_copy``: new FX nodes, their meta dicts copied shallowly, the fake tensors
shared) for as long as its compiled code lives, so that a call with inputs typed otherwise
is checked again.  This trains torchtitan's Llama3 (tiny: dim 64, 2 layers, its default
``spmd_types`` path, TP + SP on 2 ranks as threads, one step, no Inductor) and measures each
copy with ``tracemalloc`` (Python allocations while the copy is made; the ranks' threads
allocate little meanwhile, so a row may include a few of theirs).

    python benchmarks/spmd_carry_memory.py
"""

from __future__ import annotations

import sys
import tracemalloc
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "clients")]


def main() -> None:
    import dtcompile.pipeline.graph_compile as graph_compile

    warnings.filterwarnings("ignore")
    copy = graph_compile.traced_copy
    rows: list[tuple[str, int, int]] = []

    def measured(gm):  # noqa: ANN001, ANN202
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        out = copy(gm)
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        what = "block forward" if "aten.mm" in gm.code else "loss forward"
        rows.append((what, len(gm.graph.nodes), sum(s.size_diff for s in after.compare_to(before, "filename"))))
        return out

    graph_compile.traced_copy = measured
    import test_torchtitan_spmd_types as titan
    from support.titan import global_batches, initial_weights, torchtitan_on_cpu

    from dtcompile.testing import run_threaded

    def on_rank(rank: int) -> None:
        weights = initial_weights(titan.MODELS["llama3"]())
        batches = global_batches(1, titan.VOCAB_SIZE, titan.SEQ_LEN, titan.GLOBAL_BATCH)
        titan._train_on_rank(rank, "llama3", {"inductor": False}, weights, batches, "tp_sp")

    with torchtitan_on_cpu(spmd_backend="spmd_types"):
        run_threaded(2, on_rank)
    graph_compile.traced_copy = copy
    print("| graph kept (per rank) | nodes | host bytes |")
    print("| --- | ---: | ---: |")
    for what, nodes, size in rows:
        print(f"| {what} | {nodes} | {size:,} |")


if __name__ == "__main__":
    main()
