"""The idiom corpus on stock torch and on dtcompile, for the torch that is installed.

Usage: ``python benchmarks/idioms.py`` (about a minute on 2 cores).

Each idiom (``dtcompile/_testing/idioms.py``: DeviceMesh, Placement,
ProcessGroup and DTensor API code that training code writes inside compiled
regions) is compiled with ``fullgraph=True`` and compared with eager: values,
placements, gradients, the user's mesh on every result, no recompile on a second
call.  Two fresh processes, one per side:

- stock: ``aot_eager`` with dynamo_vars uninstalled and DTensor's sharding caches
  left as they are between programs (as a user without dtcompile runs);
- dtcompile: ``dtcompile.backend(inductor=False)`` (dynamo_vars installed).

Prints one table: the torch version, how many idioms each side passes, and each
idiom that fails on either side with the first line of its error.  Run it in
each torch's venv to measure what dtcompile adds per release
(``benchmarks/RESULTS.md``, "Idioms per torch release").
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_SIDES = {
    "stock": 'corpus_failures("aot_eager", stock=True)',
    "dtcompile": "corpus_failures(dtcompile.backend(inductor=False))",
}


def failures(side: str) -> dict[str, str]:
    script = textwrap.dedent(
        f"""
        import json, warnings
        warnings.simplefilter("ignore")
        import dtcompile
        from dtcompile._testing.idioms import corpus_failures
        print(json.dumps({_SIDES[side]}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import torch

    from dtcompile._testing.idioms import IDIOMS

    results = {side: failures(side) for side in _SIDES}
    total = len(IDIOMS)
    print(f"torch {torch.__version__}: {total} idioms (fullgraph, equal to eager, the user's mesh, no recompile)")
    print()
    print("| side | passed | failed |")
    print("|---|---|---|")
    for side, failed in results.items():
        print(f"| {side} | {total - len(failed)} | {len(failed)} |")
    print()
    names = [item.name for item in IDIOMS if any(item.name in failed for failed in results.values())]
    if names:
        print("| idiom | stock | dtcompile |")
        print("|---|---|---|")
        for name in names:
            cells = [results[side].get(name, "ok")[:90].replace("|", "/") for side in _SIDES]
            print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
