"""dtcompile on torchtitan ``graph_trainer``'s whole-step graph: the ``dtcompile`` pass pipeline.

torchtitan's ``graph_trainer`` traces a training step (forward, loss and backward)
as one ``make_fx`` graph of plain tensors and functional collectives (DTensor
unwrapped: ``make_fx_tracer.minimal_fx_tracer``), then applies the pass pipeline
its config names from ``graph_trainer.registry.PASS_PIPELINE_REGISTRY``.  Importing
this module registers a pipeline named ``dtcompile`` (:func:`step_pipeline`):
graph_trainer's own default passes (``construct_default_graph_passes``), in their order,
with dtcompile's :class:`~dtcompile.pipeline.step_pass.StepPass` in the place of the
ones that do its job (:data:`REPLACED`: the transformer-block bucketing and reordering
of the FSDP collectives, the dense-region scheduling of them).  graph_trainer's memory
policy (tagging, CPU offload, selective remat) runs before it, as before its own
bucketing, so what it saves or recomputes is decided on the graph as traced; regional
Inductor, kernel annotations and CUDA graphs run after it.  The nodes dtcompile adds
carry what those passes read (:data:`dtcompile.passes._graph.PROVENANCE`).

:class:`~dtcompile.pipeline.step_pass.StepPass` (the pass :func:`dtcompile.compile_step`
runs too) describes, prices, rewrites (bucketing, overlap, async TP, each priced under
the cost profile) and rank-checks the step graph.  The options of the registered
pipeline are :func:`configure`'s (graph_trainer's config has no place for them); by
default every dtcompile pass is on, but its re-gather of FSDP's weights in the backward
(``reshard_after_forward``), which graph_trainer's memory policy decides.  One INFO line
says that the pipeline is in use and where dtcompile's pass stands in it.

To select it from ``torchrun -m torchtitan.train``, something must import this module
first: pass ``--module dtcompile.integrations.graph_trainer.llama3`` (graph_trainer's
Llama3 configs, served with this module imported) with ``--compile.pass_pipeline
dtcompile``.  graph_trainer runs its default pipeline, silently, for a name nothing
registered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dtcompile.config import DTCompileConfig
from dtcompile.pass_names import COMMUNICATION_PASSES
from dtcompile.pipeline.step_pass import StepPass, mesh_axes_of

__all__ = ["PIPELINE_NAME", "REPLACED", "REWRITES", "StepPass", "configure", "mesh_axes_of", "pipeline_passes", "register", "step_pipeline"]

log = logging.getLogger(__name__)

PIPELINE_NAME = "dtcompile"
"""The name graph_trainer's ``--compile.pass_pipeline`` selects this pipeline by."""

# The mesh names torchtitan's ParallelDims may hold (``get_optional_mesh``).
_TITAN_MESHES = ("fsdp", "dp_shard", "dp_replicate", "dp", "tp", "cp", "ep", "efsdp", "batch", "loss", "dp_cp")


# ---------------------------------------------------------------------------
# The registered pipeline.

REWRITES = COMMUNICATION_PASSES
"""dtcompile's passes that rewrite collectives: on in the registered pipeline, in the place of
graph_trainer's passes that do the same job (:data:`REPLACED`)."""

REPLACED = ("joint_transformer_block_bucketing_reordering_pass", "schedule_fsdp_comms_to_dense_regions_pass")
"""graph_trainer's default passes whose job dtcompile's :class:`StepPass` does (bucketing and
ordering the FSDP collectives): the pass stands where the first of them stood, and they go."""

_AFTER_MEMORY_POLICY = "selective_activation_remat_pass"
"""Where the pass stands in a default list that has none of :data:`REPLACED`: after graph_trainer's memory policy."""

_DEFAULTS: dict[str, Any] = {"reshard_after_forward": False}
"""The registered pipeline's options unless :func:`configure` gives them: every dtcompile pass on, but
its re-gather of FSDP's weights in the backward (graph_trainer's memory policy decides that)."""

_options: dict[str, Any] = dict(_DEFAULTS)
pipeline_passes: list[StepPass] = []
"""The :class:`StepPass` each call of the registered pipeline made, oldest first (their records)."""


def configure(**options: Any) -> None:
    """The dtcompile options of the ``dtcompile`` pipeline's passes made from now on
    (validated now: an unknown option is a ``ValueError``), over :data:`_DEFAULTS`
    (``disable_passes=REWRITES`` leaves dtcompile describing and checking only)."""
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


def _pass_name(pass_fn: Any) -> str:
    """A pass's name as graph_trainer reads it (``functools.partial``'s function's)."""
    return getattr(getattr(pass_fn, "func", pass_fn), "__name__", repr(pass_fn))


def step_pipeline(traced_result: Any, config: Any, *, parallel_dims: Any = None) -> list[Callable[..., Any]]:
    """graph_trainer's default passes with dtcompile's :class:`StepPass` in the place of
    :data:`REPLACED` (the ``dtcompile`` pipeline; its options are :func:`configure`'s); where
    the list holds none of them, after graph_trainer's memory policy, else first.  A run that
    loads a precompiled artifact (``--compile.precompile_artifact_dir``) gets the default passes:
    its graph was rewritten when it was precompiled."""
    from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes

    passes = list(construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims))
    if getattr(getattr(config, "compile", None), "precompile_artifact_dir", None):
        log.info("dtcompile: graph_trainer pipeline %r: a precompiled artifact is loaded, dtcompile's pass is not run", PIPELINE_NAME)
        return passes
    step = StepPass(_options, _meshes_of(parallel_dims), _input_names(traced_result))
    pipeline_passes.append(step)
    names = [_pass_name(p) for p in passes]
    replaced = [i for i, name in enumerate(names) if name in REPLACED]
    if replaced:
        at = replaced[0]
    elif _AFTER_MEMORY_POLICY in names:
        at = names.index(_AFTER_MEMORY_POLICY) + 1
    else:
        at = 0
    kept = [p for i, p in enumerate(passes) if i not in replaced]
    kept.insert(at, step)  # at: the first replaced pass's place, none removed before it
    log.info(
        "dtcompile: graph_trainer pipeline %r: %s at pass %d of %d%s (options: %s)",
        PIPELINE_NAME, step.__name__, at + 1, len(kept),
        f", in place of {', '.join(names[i] for i in replaced)}" if replaced else "", step.config,
    )
    return kept


def register() -> None:
    """Registers :func:`step_pipeline` as graph_trainer's ``dtcompile`` pipeline (done on import)."""
    from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

    # What graph_trainer's register_pass_pipeline(name) decorator does.
    PASS_PIPELINE_REGISTRY[PIPELINE_NAME] = step_pipeline


register()
