"""dtcompile on torchtitan ``graph_trainer``'s whole-step graph: the ``dtcompile`` pass pipeline.

torchtitan's ``graph_trainer`` traces a training step (forward, loss and backward)
as one ``make_fx`` graph of plain tensors and functional collectives (DTensor
unwrapped: ``make_fx_tracer.minimal_fx_tracer``), then applies the pass pipeline
its config names from ``graph_trainer.registry.PASS_PIPELINE_REGISTRY``.  Importing
this module registers a pipeline named ``dtcompile``: graph_trainer's own default
passes (``construct_default_graph_passes``) with :class:`StepPass` first.

:class:`~dtcompile.pipeline.step_pass.StepPass` (:mod:`dtcompile.pipeline.step_pass`, the pass
:func:`dtcompile.compile_step` runs too) describes, prices, rewrites and rank-checks
the step graph.

The options of the registered pipeline are :func:`configure`'s (graph_trainer's
config has no place for them), dtcompile's rewrites off unless it switches them on
(:data:`REWRITES`, and the re-gather of FSDP's weights in the backward: graph_trainer's
own passes bucket and reorder after it, and its memory policy decides what to keep); a
:class:`StepPass` made directly takes its own options, rewrites on by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dtcompile.config import DTCompileConfig
from dtcompile.pass_names import COMMUNICATION_PASSES
from dtcompile.pipeline.step_pass import StepPass, mesh_axes_of

__all__ = ["PIPELINE_NAME", "REWRITES", "StepPass", "configure", "mesh_axes_of", "pipeline_passes", "register", "step_pipeline"]

PIPELINE_NAME = "dtcompile"
"""The name graph_trainer's ``--compile.pass_pipeline`` selects this pipeline by."""

# The mesh names torchtitan's ParallelDims may hold (``get_optional_mesh``).
_TITAN_MESHES = ("fsdp", "dp_shard", "dp_replicate", "dp", "tp", "cp", "ep", "efsdp", "batch", "loss", "dp_cp")


# ---------------------------------------------------------------------------
# The registered pipeline.

REWRITES = COMMUNICATION_PASSES
"""dtcompile's passes that rewrite collectives: off in the registered pipeline unless
:func:`configure` says otherwise, since graph_trainer's default passes after it bucket and
reorder the FSDP collectives themselves, matching the gather chains as traced."""

_DEFAULTS: dict[str, Any] = {"disable_passes": REWRITES, "reshard_after_forward": False}
"""The registered pipeline's options unless :func:`configure` gives them: dtcompile's rewrites
off, and its re-gather of FSDP's weights in the backward (graph_trainer's memory policy decides that)."""

_options: dict[str, Any] = dict(_DEFAULTS)
pipeline_passes: list[StepPass] = []
"""The :class:`StepPass` each call of the registered pipeline made, oldest first (their records)."""


def configure(**options: Any) -> None:
    """The dtcompile options of the ``dtcompile`` pipeline's passes made from now on
    (validated now: an unknown option is a ``ValueError``), over :data:`_DEFAULTS`
    (``disable_passes=set(), reshard_after_forward=True`` lets dtcompile rewrite)."""
    options = {**_DEFAULTS, **options}
    DTCompileConfig.from_options(dict(options))
    _options.clear()
    _options.update(options)


def _meshes_of(parallel_dims: Any) -> list[Any]:
    """The device meshes torchtitan's ``ParallelDims`` holds (none without one)."""
    meshes = []
    get = getattr(parallel_dims, "get_optional_mesh", None)
    for name in _TITAN_MESHES if get is not None else ():
        try:
            mesh = get(name)
        except (KeyError, ValueError, AttributeError, RuntimeError):
            continue
        if mesh is not None and all(mesh is not m for m in meshes):
            meshes.append(mesh)
    return meshes


def _input_names(traced_result: Any) -> list[str]:
    """The traced graph's inputs' names: a parameter's or buffer's FQN (as its module reads it)
    for each plain tensor its state unwraps into, the arguments by place."""
    from dtcompile.pipeline.reshard import module_fqn

    fqns = list(getattr(traced_result, "state_fqns", None) or ())
    layouts = getattr(traced_result, "input_subclass_layouts", None) or {}
    names = []
    for index in range(getattr(traced_result, "num_flat_inputs", 0)):
        name = module_fqn(fqns[index]) if index < len(fqns) else f"argument {index - len(fqns)}"
        layout = layouts.get(index)
        names += [name] * (layout.num_tensors if layout is not None else 1)
    return names


def step_pipeline(traced_result: Any, config: Any, *, parallel_dims: Any = None) -> list[Callable[..., Any]]:
    """graph_trainer's default passes with dtcompile's :class:`StepPass` first (the
    ``dtcompile`` pipeline; its options are :func:`configure`'s)."""
    from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes

    step = StepPass(_options, _meshes_of(parallel_dims), _input_names(traced_result))
    pipeline_passes.append(step)
    return [step, *construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims)]


def register() -> None:
    """Registers :func:`step_pipeline` as graph_trainer's ``dtcompile`` pipeline (done on import)."""
    from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

    # What graph_trainer's register_pass_pipeline(name) decorator does.
    PASS_PIPELINE_REGISTRY[PIPELINE_NAME] = step_pipeline


register()
