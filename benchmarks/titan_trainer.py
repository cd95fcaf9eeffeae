"""torchtitan's real trainer with graph_trainer's default pass pipeline and dtcompile's, side by side (issue #69).

``torchrun ... torchtitan.train`` through the test-only CPU launcher on 2 gloo ranks of this
machine (``tests/support/titan_trainer.py``): graph_trainer's Llama3 debug model
(``graph_trainer_llama3_debugmodel_sdpa``, SimpleFSDP, the whole step one graph, the default
memory policy), ``--steps`` steps, seed 42, deterministic; the two pipelines alternate,
``--rounds`` times each.  Printed per run: steps/s after the first step (which traces and
compiles), the graph passes' seconds as graph_trainer logs them, the functional collectives
of the step graph after the passes (each rank; dtcompile's bucketing before -> after too),
each rank's peak RSS, the wall time of the launch, and whether its losses equal the first
default run's.  torchtitan's trainer needs its own dependencies: ``--python`` is a venv's
Python with ``tests/clients/trainer-requirements.txt``.

    python benchmarks/titan_trainer.py --python .venv-titan/bin/python [--steps 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

from support.titan_trainer import DEFAULT, DTCOMPILE, make_assets, train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="the trainer venv's Python")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        assets = make_assets(args.python, Path(tmp) / "assets")
        for round_ in range(args.rounds):
            for name, flags in (("default", DEFAULT), ("dtcompile", DTCOMPILE)):
                run = train(args.python, assets, Path(tmp) / f"{name}{round_}", flags, steps=args.steps, measure=True)
                reference = reference or run.losses
                collectives = run.measured("collectives")
                rss = run.measured("peak RSS")
                bucketed = f"{run.bucketed[0]} -> {run.bucketed[1]}" if run.bucketed else "-"
                rows.append([
                    name, str(round_ + 1), f"{run.steps_per_s:.2f}", f"{run.passes_s:.2f}" if run.passes_s is not None else "?",
                    "/".join(str(collectives[r]) for r in sorted(collectives)), bucketed,
                    "/".join(str(rss[r]) for r in sorted(rss)), f"{run.seconds:.0f}",
                    "yes" if run.losses == reference and len(run.losses) == args.steps else "NO",
                ])
                print(f"{name} round {round_ + 1}: {run.seconds:.0f} s", file=sys.stderr, flush=True)
    header = ["pipeline", "round", "steps/s", "passes s", "collectives after (rank 0/1)",
              "dtcompile bucketing", "peak RSS MiB (rank 0/1)", "wall s", "losses = default's"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nlosses (default, first run): {' '.join(loss for _, loss in reference)}")


if __name__ == "__main__":
    main()
