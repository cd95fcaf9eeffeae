"""The per-rank-shapes fuzzer at length: N programs of the shared models, each rank fed its own sizes.

Each program (``tests/support/rank_shapes_fuzz.py``) is one of the shared models on gloo
ranks of this machine -- SimpleFSDP, the FSDP MLP, the TP + SP block and the MoE on 2
ranks, FSDP x TP on 2 x 2 -- compiled through ``torch.compile(...,
backend=dtcompile.backend(inductor=False))`` or ``dtcompile.compile_step`` (AdamW inside),
every pass on, run for 2 to 4 steps with each data-parallel coordinate fed a size drawn
for it at every step, and compared with stock eager (1e-5); its ranks' collectives must
pair (``tests/support/rank_shapes_run.py``).  The programs run ``--batch`` to a gloo world,
the 2-rank ones first.

Printed (``tests/support/rank_shapes_report.py``): the outcomes by entry and family
(ok, disagree: ``RanksDisagree``; abort: gloo, or a rank that died; mismatch: values
differ from eager's; unpaired: collectives that cannot pair; error: another exception;
invalid: stock eager refused the program), the share of equal- and of unequal-sized
programs whose forward was bucketed on every rank, each pass's rewrites likewise, the
wall time, the peak RSS of a rank process, and every distinct failure with its first
program.  ``--out FILE`` keeps every program's result as a JSON line (``--report FILE``
prints the report of such a file again).

    python benchmarks/rank_shapes_fuzz.py [--programs 1000] [--seed 66] [--batch 50] [--families simple_fsdp,moe]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/support: the fuzzer's cases, runner and report

from support.rank_shapes_fuzz import ENTRIES, FAMILIES, Case, draw_cases  # noqa: E402
from support.rank_shapes_report import format_report  # noqa: E402
from support.rank_shapes_run import CaseResult, RankOutcome, run_cases  # noqa: E402


def _load(path: Path) -> list[CaseResult]:
    results = []
    for line in path.read_text().splitlines():
        data = json.loads(line)
        case = data["case"]
        case = Case(**{
            **case,
            "sizes": tuple(tuple(tuple(size) for size in step) for step in case["sizes"]),
            "dims": tuple(tuple(d) for d in case["dims"]),
        })
        ranks = [RankOutcome(**r) for r in data["ranks"]]
        results.append(CaseResult(case, data["outcome"], data["detail"], ranks, data["note"]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=66)
    parser.add_argument("--batch", type=int, default=50, help="programs per gloo world")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"of {', '.join(FAMILIES)}")
    parser.add_argument("--entries", default=",".join(ENTRIES))
    parser.add_argument("--timeout", type=float, default=30.0, help="check_ranks_timeout_s (the groups' timeout: twice it)")
    parser.add_argument("--out", type=Path, help="each program's result as a JSON line")
    parser.add_argument("--report", type=Path, help="print the report of an --out file and exit")
    parser.add_argument("--resume", action="store_true", help="keep the programs --out already has, run the others")
    args = parser.parse_args()
    if args.report:
        print(format_report(_load(args.report), 0.0))
        return
    cases = draw_cases(args.programs, args.seed, families=args.families.split(","), entries=args.entries.split(","))
    cases.sort(key=lambda case: case.spec.world_size)  # stable: the 2-rank ones first, in drawn order
    results: list[CaseResult] = []
    if args.out and args.resume and args.out.exists():
        results = _load(args.out)
        kept = {r.case.index for r in results}
        cases = [case for case in cases if case.index not in kept]
        print(f"{len(results)} programs kept from {args.out}", flush=True)
    elif args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("")
    total = len(results) + len(cases)
    start = time.perf_counter()
    for first in range(0, len(cases), args.batch):
        chunk = cases[first:first + args.batch]
        done = run_cases(chunk, batch_size=args.batch, timeout_s=args.timeout)
        results += done
        if args.out:
            with args.out.open("a") as out:
                out.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in done)
        failed = sum(r.outcome != "ok" for r in results)
        print(f"{len(results)}/{total} programs, {failed} failed, {time.perf_counter() - start:.0f} s", flush=True)
    results.sort(key=lambda r: r.case.index)
    print()
    seconds = time.perf_counter() - start
    print(format_report(results, seconds, args.seed) + ("\n(resumed: the wall time is this run's)" if args.resume else ""))


if __name__ == "__main__":
    main()
