"""Peak memory of a compiled loss step: ``loss_parallel()`` vs the gathered logits (issue #16).

One rank (rank 0 of ``--world`` on the fake process group; its collectives
allocate their outputs as real ones do) runs the LM-head loss step compiled
with dtcompile, forward and backward:

- ``loss_parallel``: ``logits = h @ w.t()`` stays vocab-sharded and
  ``F.cross_entropy`` runs under ``loss_parallel()`` inside the compiled
  function (the backward under ``loss_parallel()`` too);
- ``gathered``: the same logits gathered (``redistribute`` to ``Replicate()``)
  before ``F.cross_entropy``, what a step without loss parallel does.

Each variant runs in a fresh process.  After compiling and one warm step, the
process's peak resident memory is reset (``/proc/self/clear_refs``) and read
back (``VmHWM``) around one more step: the step's peak, measured.  The
expected logits bytes per rank are printed next to it.

    python benchmarks/loss_parallel_memory.py [--tokens 4096 --vocab 32768 --world 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

VARIANTS = ("loss_parallel", "gathered")


def _rss_peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _reset_rss_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _run_variant(variant: str, tokens: int, dim: int, vocab: int, world: int, inductor: bool) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    import dtcompile
    from dtcompile.testing import fake_world

    def sharded(h, w, target):
        logits = h @ w.t()
        with loss_parallel():
            return F.cross_entropy(logits, target)

    def gathered(h, w, target):
        logits = (h @ w.t()).redistribute(placements=[Replicate()])
        return F.cross_entropy(logits.to_local(), target)

    fn = sharded if variant == "loss_parallel" else gathered
    torch.manual_seed(0)
    with fake_world(world) as mesh:
        h = distribute_tensor(torch.randn(tokens, dim), mesh, [Replicate()], src_data_rank=None).requires_grad_()
        w = distribute_tensor(torch.randn(vocab, dim), mesh, [Shard(0)], src_data_rank=None).requires_grad_()
        target = torch.randint(0, vocab, (tokens,))
        step = torch.compile(fn, backend=dtcompile.backend(inductor=inductor), fullgraph=True)

        def run() -> None:
            h.grad = w.grad = None
            loss = step(h, w, target)
            with loss_parallel():
                loss.backward()

        run()  # compile and warm up
        before = _rss_peak_mib()
        _reset_rss_peak()
        base = _rss_peak_mib()
        run()
        peak = _rss_peak_mib()
    return {"step_peak_mib": peak - base, "process_peak_before_mib": before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--inductor", action="store_true", help="lower with Inductor (default: inductor=False)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child process
    args = parser.parse_args()
    shape = (args.tokens, args.dim, args.vocab, args.world, args.inductor)
    if args.variant:
        print(json.dumps(_run_variant(args.variant, *shape)))
        return
    rows = {}
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens), "--dim", str(args.dim)]
        cmd += ["--vocab", str(args.vocab), "--world", str(args.world)] + (["--inductor"] if args.inductor else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    local_mib = args.tokens * (args.vocab // args.world) * 4 / 2**20
    full_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"tokens {args.tokens}, vocab {args.vocab}, world {args.world} (rank 0), fp32, inductor={args.inductor}")
    print(f"logits per rank: sharded {local_mib:.0f} MiB, gathered {full_mib:.0f} MiB")
    print("| variant | step peak MiB | vs loss_parallel |")
    print("|---|---:|---:|")
    base = rows["loss_parallel"]["step_peak_mib"]
    for variant, row in rows.items():
        print(f"| {variant} | {row['step_peak_mib']:.0f} | {row['step_peak_mib'] / base:.2f}x |")


if __name__ == "__main__":
    main()
