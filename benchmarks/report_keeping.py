"""What the report's new pieces cost a compile: the timelines and the artifacts kept beside the cache.

Every compiled graph is now played twice more (:func:`dtcompile.cost.simulate.simulate`,
before and after the passes) and, where a compile cache can serve it, its
``TORCH_TRACE`` artifacts are made and written beside the cache
(:mod:`dtcompile.base.beside_cache`) whether or not the run is traced.  This
compiles SimpleFSDP's norm-MLP stack (dim 256, hidden 1024) with ``layers``
layers on a fake world of 4 (``inductor=False``: the compile without Inductor's
codegen, so the share printed is an upper bound), then times, for its forward and
backward graphs, the two simulations and making and writing the artifacts, against
the whole compile.  Peak RSS is the process's.

    python benchmarks/report_keeping.py --layers 4 16
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch

    import dtcompile
    from dtcompile._testing.models import build_norm_mlp_stack
    from dtcompile.artifacts import keep_artifacts
    from dtcompile.cost.simulate import simulate
    from dtcompile.testing import fake_world

    print("| layers | AOT nodes (fw + bw) | compile s | 2 simulations ms | artifacts made + written ms | share of the compile | artifact bytes | peak RSS MiB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layers in opts.layers:
        torch._dynamo.reset()
        with fake_world(4, (4,), ("dp",)) as mesh:
            _, parallel, x = build_norm_mlp_stack(mesh, layers=layers)
            backend = dtcompile.backend(inductor=False)
            start = time.perf_counter()
            torch.compile(parallel, backend=backend)(x).sum().backward()
            compile_s = time.perf_counter() - start
            records = list(backend.records)
            start = time.perf_counter()
            for record in records:
                simulate(record.graph.graph, record.info.profile)
                simulate(record.graph.graph, record.info.profile)
            simulate_ms = (time.perf_counter() - start) * 1e3
            with tempfile.TemporaryDirectory() as folder:
                start = time.perf_counter()
                kept: dict[str, list[str]] = {}
                for record in records:
                    keep_artifacts(record, kept)
                    (Path(folder) / "kept.json").write_text(json.dumps(list(kept.values())))
                kept_ms = (time.perf_counter() - start) * 1e3
                size = (Path(folder) / "kept.json").stat().st_size
        nodes = sum(len(r.graph.graph.nodes) for r in records)
        share = (simulate_ms + kept_ms) / 1e3 / compile_s
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"| {layers} | {nodes} | {compile_s:.1f} | {simulate_ms:.1f} | {kept_ms:.1f} | {share:.2%} | {size} | {peak:.0f} |")


if __name__ == "__main__":
    main()
