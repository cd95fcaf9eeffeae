"""``dtcompile.auto_parallel(model, mesh, example_inputs, ...)``: choose the placements, return the parallel model.

:func:`plan` traces the model on fake tensors, builds the placement problem,
solves it and returns the :class:`~dtcompile.auto_parallel.solution.Solution`;
:func:`auto_parallel` also applies it (:mod:`dtcompile.auto_parallel.apply`).
Arguments are checked first, and a wrong one is a ``TypeError`` or
``ValueError`` that names it.  With ``TORCH_TRACE=DIR`` set, every plan also
logs its ``explain()`` as the ``dtcompile_auto_parallel_solution`` artifact.
Every plan first checks the private torch names the planner relies on
(:data:`_TORCH_NAMES`, :func:`dtcompile.base.torch_contract.require`): on a torch
that lacks one, planning is a ``TorchContractError`` naming it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from dtcompile.auto_parallel.placements import Layout, text
from dtcompile.base.channels import Artifact
from dtcompile.base.progress import Progress
from dtcompile.base.scoped_patch import ScopedPatch, fx_tracing
from dtcompile.base.torch_contract import require
from dtcompile.cost import HardwareProfile
from dtcompile.cost.auto import profile_for_groups
from dtcompile.pipeline.reshard import resharded

__all__ = ["auto_parallel", "plan"]

log = logging.getLogger(__name__)

_TORCH_NAMES: tuple[str, ...] = (
    "torch._C._AutoDispatchBelowAutograd",
    "torch._decomp.decomposition_table",
    "torch._logging.trace_structured",
    "torch._ops.OpOverload",
    "torch._subclasses.fake_tensor.DataDependentOutputException",
    "torch._subclasses.fake_tensor.DynamicOutputShapeException",
    "torch._subclasses.fake_tensor.FakeTensorMode",
    "torch.distributed.device_mesh.DeviceMesh._get_root_mesh",
    "torch.distributed.tensor.DTensor.__new__",
    "torch.distributed.tensor.DTensor._op_dispatcher._custom_op_handlers",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.op_to_schema_info",
    "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator.op_to_schema_info_for_single_dim_strategy",
    "torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached",
    "torch.distributed.tensor._collective_utils.redistribute_cost",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.DTensorSpec.is_default_device_order",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor._op_schema.OpSchema",
    "torch.distributed.tensor._op_schema.OpSchema.args_meta",
    "torch.distributed.tensor._op_schema.OpSchema.kwargs_meta",
    "torch.distributed.tensor._op_schema.OpSpec",
    "torch.distributed.tensor._op_schema.OpStrategy",
    "torch.distributed.tensor._ops.single_dim_strategy._fill_single_dim_strategy_placeholders",
    "torch.distributed.tensor._ops.single_dim_strategy._insert_single_dim_replication_strategy",
    "torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy",
    "torch.distributed.tensor._ops.utils.is_tensor_shardable",
    "torch.distributed.tensor._ops.utils.redistribute_cost",
    "torch.distributed.tensor._redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN",
    "torch.distributed.tensor._redistribute._FlattenedTransformInfo",
    "torch.distributed.tensor._redistribute._TransformInfo",
    "torch.distributed.tensor._redistribute._gen_transform_infos",
    "torch.distributed.tensor._redistribute._gen_transform_infos.cache_clear",
    "torch.distributed.tensor._redistribute._optimize_transform_infos",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.fx._lazy_graph_module._use_lazy_graph_module",
    "torch.fx.experimental.proxy_tensor.get_proxy_mode",
    "torch.ops.aten._scaled_dot_product_efficient_attention",
    "torch.ops.aten._scaled_dot_product_efficient_attention.default",
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.utils._pytree.tree_flatten",
    "torch.utils._pytree.tree_leaves",
    "torch.utils._pytree.tree_map_only",
    "torch.utils._pytree.tree_unflatten",
)
"""The private torch names the modules of :mod:`dtcompile.auto_parallel` use, each listed in
:data:`dtcompile.base.torch_contract.PRIVATE_NAMES` (with its parameters there), checked by
:func:`plan` before it starts.  ``tests/architecture/test_newer_torch.py`` reads the package's
code with the contract test's scanner and fails on a private name used and missing here,
and on a name here the package no longer mentions.  The lower layers the planner calls
(:mod:`dtcompile.base`, :mod:`dtcompile.hops`, :mod:`dtcompile.pipeline.reshard`...) are not covered."""


class _OtherThreads(logging.Filter):
    """Lets through only records logged by other threads than the one that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextlib.contextmanager
def _without_redistribution_advice() -> Iterator[None]:
    """DTensor warns, on its logger, about every redistribution it must split into several
    collectives (``While redistributing from ... 2 sequential all_gather operations``); the
    planner tries thousands of layouts, and prices each transfer it keeps, so the advice is
    dropped while this thread plans (other threads' warnings still show)."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    quiet = _OtherThreads()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _freeze_heap() -> Callable[[], None]:
    """Moves the objects the process holds before a plan out of the garbage collector's
    sight until the plan ends (``gc.freeze()``, then ``gc.unfreeze()``).

    A plan makes and drops hundreds of thousands of small objects (specs, graphs, shards),
    so the collector runs its full collection a few times, and each one walks the whole
    heap: with torch and transformers loaded, 0.2 s each, a tenth of a one-layer plan.  The
    collector still frees what the plan drops; what was there before is left alone, as it
    would have survived anyway.  A process that froze objects itself (``gc.get_freeze_count()``)
    is left as it is: unfreezing would hand it back the objects it froze."""
    if gc.get_freeze_count():
        return lambda: None
    gc.freeze()
    return gc.unfreeze


_frozen_heap = ScopedPatch(_freeze_heap)
"""``with _frozen_heap():`` the objects made before are frozen (see :func:`_freeze_heap`);
held by every thread that plans, undone when the last one ends."""


def _layout(what: str, value: Any, mesh: Any) -> Layout:
    """A pinned layout: placements, one per mesh axis, or SPMD types by mesh axis name
    (``{"dp": "S(0)", "tp": "R"}``: :func:`dtcompile.hops.spec.placements_of_types`)."""
    from torch.distributed.tensor import Placement

    from dtcompile.hops.spec import placements_of_types

    if isinstance(value, Mapping):
        value = placements_of_types(value, mesh, f"auto_parallel: {what}")
    if isinstance(value, Placement):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(p, Placement) for p in value):
        raise TypeError(f"auto_parallel: {what} must be a sequence of Placement (one per mesh axis), got {value!r}")
    if len(value) != mesh.ndim:
        raise ValueError(
            f"auto_parallel: {what} has {len(value)} placements for a {mesh.ndim}-D mesh; give one per mesh axis"
        )
    if any(p.is_partial() for p in value):
        raise ValueError(f"auto_parallel: {what} is {tuple(value)}; a pinned layout cannot be Partial")
    return tuple(value)


def _compile_config(config: Any, profile: Any) -> tuple[Any, int | None, Any]:
    """``(cost profile, bucket_cap_bytes or None, the config)`` from the config the model will be compiled with."""
    from dtcompile.config import DTCompileConfig

    config = getattr(config, "config", config)  # a dtcompile.backend(...) carries its config
    if config is None:
        config = DTCompileConfig()
    elif not isinstance(config, DTCompileConfig):
        raise TypeError(
            f"auto_parallel: config must be the DTCompileConfig (or dtcompile.backend(...)) the model will be "
            f"compiled with, got {type(config).__name__}"
        )
    elif profile is not None and (profile if isinstance(profile, str) else getattr(profile, "name", None)) != config.cost_profile:
        raise ValueError(
            f"auto_parallel: cost_profile={profile!r} but the compile config's cost_profile is {config.cost_profile!r}; "
            "give one of them"
        )
    bucket_cap = None if "bucketing" in config.disable_passes else config.bucket_cap_bytes
    return (profile if profile is not None else config.cost_profile), bucket_cap, config


def _step_budget(budget: Any, config: Any) -> int | None:
    """The step's memory budget: ``memory_budget_bytes``, else the compile config's (one budget
    serves the plan and the compile)."""
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise ValueError(f"auto_parallel: memory_budget_bytes must be an int >= 1 or None, got {budget!r}")
    if budget is not None and config.memory_budget_bytes is not None and budget != config.memory_budget_bytes:
        raise ValueError(
            f"auto_parallel: memory_budget_bytes={budget} but the compile config's memory_budget_bytes is "
            f"{config.memory_budget_bytes}; give one of them (the plan and the compile keep to one budget)"
        )
    return budget if budget is not None else config.memory_budget_bytes


def _check(model: Any, mesh: Any, example_inputs: Any, budget: Any, profile: Any) -> tuple[tuple[Any, ...], HardwareProfile]:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_parallel: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"auto_parallel: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            f"auto_parallel: example_inputs must be a tuple of the model's positional arguments, got {type(example_inputs).__name__}"
        )
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("auto_parallel: the model already has DTensor parameters; pass the single-device model")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise ValueError(f"auto_parallel: param_memory_budget_bytes must be an int >= 0 or None, got {budget!r}")
    if not isinstance(profile, (str, HardwareProfile)):
        raise TypeError(f"auto_parallel: cost_profile must be a profile name or a HardwareProfile, got {profile!r}")
    # "auto" reads the mesh as the backend reads a graph: its device and its groups' backend.
    names = [mesh.get_group(axis).group_name for axis in range(mesh.ndim)]
    profile = profile_for_groups(profile, {mesh.device_type}, names).profile
    return tuple(example_inputs), profile


def plan(
    model: nn.Module,
    mesh: Any,
    example_inputs: Any,
    *,
    input_placements: Sequence[Any] | None = None,
    output_placements: Sequence[Any] | None = None,
    param_memory_budget_bytes: int | None = None,
    fixed: Mapping[str, Any] | None = None,
    cost_profile: str | HardwareProfile | None = None,
    config: Any = None,
    memory_budget_bytes: int | None = None,
    optimizer: Any = None,
) -> Any:
    """Choose every parameter's, input's, output's and op's placements; returns the
    :class:`~dtcompile.auto_parallel.solution.Solution` (see :func:`auto_parallel`).

    A torch that lacks one of the private names the planner relies on (:data:`_TORCH_NAMES`)
    is a :class:`~dtcompile.base.torch_contract.TorchContractError` naming it, before any
    argument is read."""
    require(_TORCH_NAMES, "dtcompile.auto_parallel")

    from dtcompile.auto_parallel.agreement import MadeFrom, peers_learn_failure
    from dtcompile.auto_parallel.local_ops import decomposition_for
    from dtcompile.auto_parallel.peak import optimizer_states, step_memory
    from dtcompile.auto_parallel.problem import build_problem
    from dtcompile.auto_parallel.solution import Solution
    from dtcompile.auto_parallel.solver import solve
    from dtcompile.auto_parallel.trace import trace_forward
    from dtcompile.auto_parallel.tying import tie_repeated_layers
    from dtcompile.cache_keys import key_fields

    cost_profile, bucket_cap_bytes, config = _compile_config(config, cost_profile)
    with peers_learn_failure(mesh, config):
        example_inputs, profile = _check(model, mesh, example_inputs, param_memory_budget_bytes, cost_profile)
        memory_budget_bytes = _step_budget(memory_budget_bytes, config)
        states = optimizer_states(optimizer)
        num_inputs = len(pytree.tree_leaves(example_inputs))
        pinned: dict[str, Layout] = {}
        if input_placements is not None:
            if len(input_placements) != num_inputs:
                raise ValueError(
                    f"auto_parallel: input_placements has {len(input_placements)} entries for {num_inputs} inputs; "
                    "give one per (flattened) input, None to let the solver choose"
                )
            for i, value in enumerate(input_placements):
                if value is not None:
                    pinned[f"input{i}"] = _layout(f"input_placements[{i}]", value, mesh)
        params = dict(model.named_parameters())
        for name, value in (fixed or {}).items():
            if name not in params and not (name.startswith("input") and name[5:].isdigit() and int(name[5:]) < num_inputs):
                raise ValueError(
                    f"auto_parallel: fixed names {name!r}, which is neither a parameter of the model nor "
                    f"input0..input{num_inputs - 1}; the parameters are {sorted(params)}"
                )
            pinned[name] = _layout(f"fixed[{name!r}]", value, mesh)
        outs: dict[int, Layout] = {}
        for i, value in enumerate(output_placements or ()):
            if value is not None:
                outs[i] = _layout(f"output_placements[{i}]", value, mesh)

        # fx_tracing(): torch.fx's tracer patches process-wide state, so plans (and the whole step's
        # traces) in one process run in turn. Ranks run as threads may all call plan; each after
        # the first reads what the first measured.
        with fx_tracing(), Progress("auto_parallel", 4, unit="stage") as progress, _without_redistribution_advice(), \
                _frozen_heap():
            start = time.perf_counter()
            traced = trace_forward(model, example_inputs, mesh.device_type, decompose=decomposition_for)
            traced_s = time.perf_counter() - start
            progress.step("traced")
            problem = build_problem(
                traced, mesh, profile, fixed=pinned, output_layouts=outs, bucket_cap_bytes=bucket_cap_bytes,
                resharded=functools.partial(resharded, config=config),
            )
            problem.seconds["trace"] = traced_s
            progress.step("problem built")
            tie_repeated_layers(problem)
            progress.step("layers tied")
            # The peak model is built where a budget asks for it (else when the solution is asked).
            start = time.perf_counter()
            memory = step_memory(problem, states) if memory_budget_bytes is not None else None
            problem.seconds["memory"] = time.perf_counter() - start
            result = solve(problem, param_memory_budget_bytes=param_memory_budget_bytes, memory=memory,
                           memory_budget_bytes=memory_budget_bytes)
            problem.seconds["solve"] = result.seconds
            progress.step("solved")
        log.info(
            "auto_parallel: %d nodes in %d groups, %d variables; solved in %.2fs, estimated step %.2f us",
            len(problem.nodes), result.num_groups, result.num_variables, result.seconds, result.objective_us,
        )
        made_from = MadeFrom.of(config, example_inputs, profile, {
            "param_memory_budget_bytes": param_memory_budget_bytes, "memory_budget_bytes": memory_budget_bytes,
            "optimizer states": states, "pinned": {name: text(layout) for name, layout in pinned.items()},
            "output_placements": {i: text(layout) for i, layout in outs.items()}, **key_fields(config),
        })
        solution = Solution(problem, result, param_memory_budget_bytes, memory, memory_budget_bytes, states, made_from)
        # tlparse shows it beside the compiles' artifacts (TORCH_TRACE=DIR).
        torch._logging.trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": Artifact.AUTO_PARALLEL_SOLUTION, "encoding": "string"},
            payload_fn=solution.explain,
        )
    return solution


def auto_parallel(
    model: nn.Module,
    mesh: Any,
    example_inputs: Any,
    *,
    input_placements: Sequence[Any] | None = None,
    output_placements: Sequence[Any] | None = None,
    param_memory_budget_bytes: int | None = None,
    fixed: Mapping[str, Any] | None = None,
    cost_profile: str | HardwareProfile | None = None,
    config: Any = None,
    memory_budget_bytes: int | None = None,
    optimizer: Any = None,
) -> tuple[nn.Module, Any]:
    """Choose the placements of ``model`` on ``mesh`` and return ``(parallel_model, solution)``.

    ``example_inputs``: the model's positional arguments (global shapes; real,
    fake or ``meta`` tensors: only shapes and dtypes are read).
    ``input_placements`` / ``output_placements``: per flattened input / output,
    a placements tuple to pin, or ``None`` to let the solver choose.
    ``param_memory_budget_bytes``: the most parameter bytes one rank may hold.
    ``memory_budget_bytes``: the most bytes one rank may hold at the training step's
    peak (parameters, gradients, ``optimizer``'s state, inputs, and what the forward
    saves for the backward: :mod:`dtcompile.auto_parallel.peak`); default the compile
    config's ``memory_budget_bytes``, so one budget serves the plan and the compile.  A
    budget below the least peak any plan reaches is an
    :class:`~dtcompile.auto_parallel.solver.Infeasible` naming that peak.
    ``optimizer``: the optimizer the step runs (``"adam"``, ``torch.optim.AdamW``...:
    :data:`~dtcompile.auto_parallel.peak.OPTIMIZER_STATES`), for its state; ``None``:
    none counted.
    ``fixed``: parameter name (or ``input0``...) -> placements to pin.
    ``cost_profile``: the hardware profile the costs are estimated with (default: the
    config's, ``"auto"``: the profile of the mesh's device and its groups' backend, as
    the backend picks it for a graph: ``h100`` on the fake and threaded test worlds,
    ``cpu_gloo`` on gloo).
    ``config``: the :class:`~dtcompile.config.DTCompileConfig` (or ``dtcompile.backend(...)``)
    the model will be compiled with: parameter collectives are priced as its ``bucketing``
    pass merges them (its ``bucket_cap_bytes``; one by one where it disables the pass), and
    its ``cost_profile`` is the default.

    Every rank plans for itself; before the plan is applied, the mesh's ranks compare
    their plans, and where they differ (each rank's own batch shapes, budgets or cost
    profile) every rank raises :class:`~dtcompile.ranks.check.RanksDisagree` saying how
    (:mod:`dtcompile.auto_parallel.agreement`; off with the config's ``check_ranks=False``).

    ``parallel_model`` is a copy of ``model`` whose parameters are DTensors in the
    chosen placements; it takes this rank's local shard of each input in
    ``solution.input_placements`` (or any DTensor) and returns DTensors in
    ``solution.output_placements``.  It runs eagerly and compiles with
    ``torch.compile(parallel_model, backend="dtcompile")``.
    """
    from dtcompile.auto_parallel.apply import parallelize

    solution = plan(
        model, mesh, example_inputs, input_placements=input_placements, output_placements=output_placements,
        param_memory_budget_bytes=param_memory_budget_bytes, fixed=fixed, cost_profile=cost_profile, config=config,
        memory_budget_bytes=memory_budget_bytes, optimizer=optimizer,
    )
    start = time.perf_counter()
    parallel = parallelize(model, solution)
    solution.problem.seconds["apply"] = time.perf_counter() - start
    return parallel, solution
