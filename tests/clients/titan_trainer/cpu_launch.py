"""torchtitan 0.3.0's own trainer (``torchtitan.train``) on CPU, with gloo, for one rank of ``torchrun``.

Run as ``PYTHONPATH=. torchrun --nproc-per-node 2 tests/clients/titan_trainer/cpu_launch.py``
followed by torchtitan's own flags (``--module graph_trainer.llama3 --config
graph_trainer_llama3_debugmodel_sdpa ...``), from the repository root.  Everything after the
launcher's name goes to torchtitan's ``ConfigManager``: its CLI, its config registry, its
dataloader, tokenizer, metrics and graph_trainer's pass pipeline are used unchanged.

What is adapted, before anything of torchtitan's but ``torchtitan.tools.utils`` is imported (the
others copy ``device_type``/``device_module`` at their import):

- torchtitan takes ``"cuda"`` when torch finds no accelerator (``tools/utils.get_device_info``);
  here it is ``"cpu"``, so ``init_distributed`` picks gloo
  (``torch.distributed.Backend.default_device_backend_map["cpu"]``) and the model is built on CPU.
- ``torch.cpu`` has no memory statistics; torchtitan's ``DeviceMemoryMonitor`` reads
  ``get_device_name``, ``get_device_properties(...).total_memory``, ``memory_stats`` and
  ``reset_peak_memory_stats``/``empty_cache``: :data:`CPU_DEVICE_MODULE` adds them (no statistics:
  the monitor reports -1 bytes, as it does for a device without them).  Its ``current_device``
  is ``0``, not ``torch.cpu``'s ``"cpu"``: ``set_pg_timeouts`` passes it to ``barrier(device_ids=...)``,
  which takes integers.

``DTCOMPILE_OPTIONS``, when set, is a JSON object: :mod:`dtcompile.integrations.torchtitan` is
imported (registering the ``dtcompile`` pass pipeline, selected with ``--compile.pass_pipeline
dtcompile``) and configured with it (list values become sets: ``{"disable_passes": []}`` switches
dtcompile's rewrites on).

``TITAN_CPU_LAUNCH_MEASURE=1`` (``benchmarks/titan_trainer.py``, the client test) makes each
rank print, as ``[cpu_launch] rank R ...`` lines, what the step graph holds after the
pipeline's passes (graph_trainer's ``apply_graph_passes`` wrapped): its functional
collectives, and what the memory policy left in it (the nodes graph_trainer's remat pass
duplicated for the backward, ``*_recomputed``, that compute rather than gather a weight; the
offload policy's ``ao.offload``/``ao.reload``/``ao.wait_tensor``), and, at exit, its peak
resident memory (``ru_maxrss``).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import types
from typing import Any

import torch

__all__ = ["CPU_DEVICE_MODULE", "configure_dtcompile", "main", "point_torchtitan_at_cpu"]


class _CpuDeviceProperties:
    """What torchtitan reads of ``get_device_properties``: the host's memory as the capacity."""

    name = "CPU"

    def __init__(self) -> None:
        self.total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


CPU_DEVICE_MODULE = types.ModuleType("torch_cpu_for_torchtitan", "torch.cpu with the memory calls torchtitan makes.")
CPU_DEVICE_MODULE.__dict__.update(
    {name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("__")}
)
CPU_DEVICE_MODULE.__dict__.update(
    current_device=lambda: 0,
    get_device_name=lambda device=None: "CPU",
    get_device_properties=lambda device=None: _CpuDeviceProperties(),
    memory_stats=lambda device=None: {},
    reset_peak_memory_stats=_no_op,
    empty_cache=_no_op,
)


def point_torchtitan_at_cpu() -> None:
    """Makes ``torchtitan.tools.utils`` say CPU; must run before the rest of torchtitan is imported."""
    from torchtitan.tools import utils

    utils.device_type, utils.device_module = "cpu", CPU_DEVICE_MODULE


def configure_dtcompile(options_json: str | None) -> None:
    """Imports and configures dtcompile's torchtitan pipeline when ``DTCOMPILE_OPTIONS`` is set."""
    if options_json is None:
        return
    options = json.loads(options_json)
    if not isinstance(options, dict):
        raise ValueError(f"DTCOMPILE_OPTIONS: expected a JSON object, found {options_json!r}")
    from dtcompile.integrations import torchtitan as dtcompile_titan

    dtcompile_titan.configure(
        **{key: set(value) if isinstance(value, list) else value for key, value in options.items()}
    )


def measure() -> None:
    """The ``TITAN_CPU_LAUNCH_MEASURE`` lines (see the module doc)."""
    from torchtitan.experiments.graph_trainer import trainer

    from dtcompile.base.op_facts import UNSHARD_OPS, op_name
    from dtcompile.graph.collectives import is_collective

    rank = os.environ.get("RANK", "?")
    apply = trainer.apply_graph_passes

    def counted(gm: Any, *args: Any, **kwargs: Any) -> Any:
        gm = apply(gm, *args, **kwargs)
        nodes = list(gm.graph.nodes)
        count = sum(1 for node in nodes if is_collective(node))
        print(f"[cpu_launch] rank {rank} collectives after the passes: {count}", flush=True)
        # Compute, not the gathers' plumbing (their views, copies and casts, which each
        # pipeline's bucketing rewrites in its own way).
        recomputed = sum(
            1 for node in nodes
            if node.op == "call_function" and node.name.endswith("_recomputed")
            and op_name(node.target) not in UNSHARD_OPS | {"getitem"} and not is_collective(node)
        )
        print(f"[cpu_launch] rank {rank} recomputed nodes after the passes: {recomputed}", flush=True)
        for op in ("offload", "reload", "wait_tensor"):
            target = getattr(getattr(torch.ops, "ao", None), op, None)
            found = sum(1 for node in nodes if target is not None and node.target == target.default)
            print(f"[cpu_launch] rank {rank} ao.{op} after the passes: {found}", flush=True)
        return gm

    trainer.apply_graph_passes = counted
    atexit.register(
        lambda: print(f"[cpu_launch] rank {rank} peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB", flush=True)
    )


def main() -> None:
    point_torchtitan_at_cpu()
    configure_dtcompile(os.environ.get("DTCOMPILE_OPTIONS"))
    if os.environ.get("TITAN_CPU_LAUNCH_MEASURE") == "1":
        measure()
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
