"""Which torch dtcompile is written for, and the private torch names it relies on.

dtcompile reaches into ~150 private names of torch (Dynamo's variable builder
and guard builder, the HOP tracing helpers, DTensor's sharding caches...).
Their contract is not public, so it is fenced:

- :data:`TESTED_TORCH` is the range of torch versions the package is tested
  on (2.13, 2.14 and 2.15); :func:`torch_is_supported` says whether the
  running torch is in it, :func:`torch_is_newer` whether it is past it.
  ``pyproject.toml`` declares the lower bound only: a newer torch is judged
  by this contract, not by its version.  ``dynamo_vars.install()`` installs
  on a tested torch; on a newer one it checks the contract once
  (:func:`contract_breaks`) and installs where it holds (one log line says
  so), else stays off with one warning naming what broke; on an older one it
  stays off with one warning;
- :data:`PRIVATE_NAMES` lists every private name used, with the parameters
  dtcompile passes and, for a name only some supported releases have, which
  (:mod:`dtcompile.base.torch_compat` chooses between them; a torch newer
  than the range is expected to have the newest tested release's names);
  ``tests/architecture/test_torch_contract.py`` asserts each still exists
  with that signature on the running torch (:func:`problem`), and reads the
  code to fail on a private name missing here, so an upgrade that moves one
  fails in one readable test instead of silently (a guard that no longer
  explains itself, a region whose backward is paired wrongly);
- :data:`PATCHED` lists every torch object that dynamo_vars replaces while
  installed; ``dynamo_vars.uninstall()`` restores each.  Every other change
  dtcompile makes to the process (the partitioner's rules and ``copyreg``'s
  table during a compile, the registry, the test worlds' swaps) is listed, with
  how long it lasts, in :mod:`dtcompile.base.process_changes`;
- :func:`require` is a feature's check at its entry (``dtcompile.auto_parallel``'s
  ``plan``, the passes' ``run_passes``), each feature naming its private names in
  one tuple (``_TORCH_NAMES`` in its module; ``tests/architecture/test_newer_torch.py``
  reads the feature's code with the contract test's scanner and fails on a name
  the tuple misses): a private name it needs that the running torch lacks is a
  :class:`TorchContractError` naming it, never an ``AttributeError`` from deep
  inside.  On a tested torch it checks only that the names are listed: the
  contract test asserts every listed name on each tested release.

Upgrading torch: run that test on the new release first; each line it fails
on is a name to add to :mod:`dtcompile.base.torch_compat` (one function per
difference) and to list here with the releases that have it.

Bottom layer: imports nothing of dtcompile's, and torch only inside functions.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from typing import Any, NamedTuple

__all__ = [
    "PATCHED",
    "PRIVATE_NAMES",
    "TESTED_TORCH",
    "Break",
    "PrivateName",
    "TorchContractError",
    "applies",
    "contract_breaks",
    "describe",
    "last_tested",
    "own_attribute",
    "problem",
    "require",
    "resolve",
    "tested_range",
    "torch_is_newer",
    "torch_is_supported",
]

TESTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 13), (2, 16))
"""``[low, high)``: the torch (major, minor) versions dtcompile is tested on."""


def _parsed(version: str | None) -> Any:
    from torch.torch_version import TorchVersion

    if version is None:
        import torch

        version = torch.__version__
    # TorchVersion compares as a version (2.13.0+cpu >= (2, 13)), not as a string.
    return TorchVersion(version)


def torch_is_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the running torch's) is in :data:`TESTED_TORCH`."""
    low, high = TESTED_TORCH
    parsed = _parsed(version)
    return parsed >= low and parsed < high


def torch_is_newer(version: str | None = None) -> bool:
    """Whether ``version`` (default: the running torch's) is past :data:`TESTED_TORCH`
    (``2.16.0``, ``2.16.0+cu130``: judged by the contract, not refused)."""
    return _parsed(version) >= TESTED_TORCH[1]


def last_tested() -> tuple[int, int]:
    """The newest torch release in :data:`TESTED_TORCH`: ``(2, 15)``."""
    (major, minor) = TESTED_TORCH[1]
    assert minor > 0, TESTED_TORCH  # the range ends before a x.0 release: name its last one here
    return (major, minor - 1)


def tested_range() -> str:
    """:data:`TESTED_TORCH` as a pip specifier: ``>=2.13,<2.16``."""
    (low, high) = TESTED_TORCH
    return f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"


class PrivateName(NamedTuple):
    """One private torch name dtcompile uses."""

    module: str
    path: str
    """The attribute path inside ``module`` (``GuardBuilder.EQUALS_MATCH``)."""
    params: tuple[str, ...] | None = None
    """Parameter names the call sites rely on; None: only its existence matters."""
    versions: tuple[tuple[int, int], tuple[int, int]] | None = None
    """``[low, high)`` of the supported releases that have it; None: every one.  A range
    ending where :data:`TESTED_TORCH` ends goes on: a newer torch is expected to have it."""

    @property
    def dotted(self) -> str:
        """``module.path``, as the code spells it (``torch._dynamo.guards.GuardBuilder.EQUALS_MATCH``)."""
        return f"{self.module}.{self.path}"


def applies(name: PrivateName, version: tuple[int, int] | None = None) -> bool:
    """Whether the release ``version`` (default: the running torch's) has ``name``.

    A release past :data:`TESTED_TORCH` is expected to have what the newest tested
    one has: the names of every release, and those of the newest releases only."""
    if name.versions is None:
        return True
    if version is None:
        from dtcompile.base.torch_compat import torch_version

        version = torch_version()
    low, high = name.versions
    return low <= version and (version < high or high == TESTED_TORCH[1])


_P = PrivateName
_UNTIL_2_14 = ((2, 13), (2, 14))
_FROM_2_14 = ((2, 14), (2, 16))
_FROM_2_15 = ((2, 15), (2, 16))

# Kept in the order of the layers that use them.
PRIVATE_NAMES: tuple[PrivateName, ...] = tuple(_P(*entry) for entry in (
    # dtcompile.base.notation, dynamo_vars.guards
    ("torch._library.fake_class_registry", "FakeScriptObject", None),
    # dtcompile.base.sizes: sizes read without guarding
    ("torch.fx.experimental.symbolic_shapes", "optimization_hint", ("a", "fallback")),
    ("torch.fx.experimental.symbolic_shapes", "free_unbacked_symbols", ("x",)),
    # dtcompile.base.scoped_patch.fx_tracing: Dynamo's compile lock, held by our own torch.fx traces
    ("torch._dynamo.convert_frame", "compile_lock", None),
    # dtcompile.base.sharding_cache
    ("torch._C", "_clear_DTensor_sharding_propagator_cache", None),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache", ()),
    ("torch.distributed.tensor._dispatch", "OpDispatcher", None),
    # hops
    ("torch._ops", "HigherOrderOperator.py_impl", ("self", "k")),
    ("torch._ops", "HigherOrderOperator.py_functionalize_impl", ("self", "fn")),
    ("torch._higher_order_ops.utils", "reenter_make_fx", ("fn",)),
    ("torch._higher_order_ops.utils", "register_fake", ("hop", "fn", "skip_cache")),
    ("torch._higher_order_ops.utils", "unique_graph_id", ("proxy_mode", "prefix")),
    ("torch._higher_order_ops.utils", "redirect_to_mode", ("hop", "mode")),
    ("torch.utils.checkpoint", "_CachingTorchDispatchMode", None),
    ("torch.utils.checkpoint", "_CachedTorchDispatchMode", None),
    ("torch._C", "_AutoDispatchBelowAutograd", None),
    ("torch._dispatch.python", "suspend_functionalization", ()),
    ("torch._subclasses.functional_tensor", "disable_functional_mode", ()),
    ("torch._functorch.partitioners", "default_partition", ("joint_module", "_joint_inputs", "num_fwd_outputs")),
    ("torch._guards", "detect_fake_mode", ("inputs",)),
    # dtcompile.spmd.inference: the FSDP2 modules alive, for the types FSDP2 saved for their parameters
    ("torch.distributed._composable_state", "_module_state_mapping", None),
    # dtcompile.spmd.layouts: the frame Dynamo translates (its modules' declared input layouts)
    ("torch._dynamo.symbolic_convert", "InstructionTranslator.current_tx", ()),
    ("torch.distributed._local_tensor", "LocalTensor", None),
    ("torch.distributed._local_tensor", "LocalTensorMode", None),
    # dynamo_vars
    ("torch._dynamo.variables.builder", "VariableBuilder._id_dispatch", ()),
    ("torch._dynamo.guards", "GuardBuilder.DTENSOR_SPEC_MATCH", ("self", "guard")),
    ("torch._dynamo.guards", "GuardBuilder.CLOSURE_MATCH", ("self", "guard")),
    ("torch._dynamo.guards", "check_dtensor_spec", None),
    ("torch._dynamo.guards", "extract_dtensor_spec", None),
    ("torch._dynamo.guards", "check_opaque_obj", None),
    ("torch._dynamo.guards", "extract_opaque_obj", None),
    ("torch._library.opaque_object", "_resolve_opaque_type_info", ("cls",)),
    ("torch._library.opaque_object", "MemberType", None),
    ("torch._dynamo.exc", "unimplemented", ("gb_type", "context", "explanation", "hints")),
    ("torch._dynamo.variables.higher_order_ops", "WrapHigherOrderVariable.create_wrapped_node", None),
    ("torch._dynamo.variables.higher_order_ops", "_call_function_with_auto_output_flattening", None),
    ("torch._dynamo.variables.lazy", "LazyVariableTracker.realize_all", None),
    ("torch._dynamo.variables.base", "ValueMutationNew", None),
    ("torch._dynamo.utils", "_get_fake_value_impl", ("node", "tx", "allow_non_graph_fake")),
    ("torch._dynamo.variables.tensor", "TensorVariable.call_method", ("self", "tx", "name", "args", "kwargs")),
    ("torch.fx.experimental.symbolic_shapes", "ShapeEnv.ignore_fresh_unbacked_symbols", ("self",)),
    # dtcompile.base.torch_compat.script_object_variable: renamed in torch 2.14
    ("torch._dynamo.variables.script_object", "TorchScriptObjectVariable.call_method",
     ("self", "tx", "name", "args", "kwargs"), _UNTIL_2_14),
    ("torch._dynamo.variables.script_object", "CustomClassObjectVariable.call_method",
     ("self", "tx", "name", "args", "kwargs"), _FROM_2_14),
    # dtcompile.base.torch_compat.variable_getattr: renamed in torch 2.14
    ("torch._dynamo.variables.base", "VariableTracker.var_getattr", ("self", "tx", "name"), _UNTIL_2_14),
    ("torch._dynamo.variables.base", "VariableTracker.tp_getattro_impl", ("self", "tx", "name"), _FROM_2_14),
    # dtcompile.base.torch_compat.fake_tensor_call_errors: new in torch 2.14
    ("torch._dynamo.exc", "FakeTensorObservedException", None, _FROM_2_14),
    ("torch._subclasses.fake_tensor", "unset_fake_temporarily", ()),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten", ("self", "mesh_dim_name")),
    ("torch._dynamo.backends.registry", "_COMPILER_FNS", None),
    ("torch._dynamo.backends.registry", "_BACKENDS", None),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", None),
    ("torch.distributed.device_mesh", "_mesh_resources", None),
    ("torch.distributed.device_mesh", "DeviceMesh._get_root_mesh", ("self",)),
    # dtcompile.base.sharding_cache and the threaded world: per-rank plans, a shared fake mode
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear", None),
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator._fake_mode_lock", None),
    # the backend
    ("torch._inductor.compile_fx", "compile_fx", ("model_", "example_inputs_", "inner_compile", "config_patches")),
    ("torch._inductor.compile_fx", "compile_fx_inner", ("gm", "example_inputs")),
    ("torch._inductor.compile_fx", "select_decomp_table", ()),
    ("torch._inductor.custom_graph_pass", "CustomPartitionerFn", None),
    ("torch._inductor.config", "custom_partitioner_fn", None),
    ("torch._functorch.partitioners", "min_cut_rematerialization_partition", ("joint_module", "_joint_inputs", "compiler")),
    # the default partitioner's dead-code pass looks it up by name at call time
    ("torch._functorch.partitioners", "is_not_collective", ("node",)),
    ("torch._functorch.partitioners", "_must_be_in_forward", ("node",)),
    ("torch._functorch.aot_autograd", "make_boxed_func", ("f",)),
    ("torch._functorch.config", "enable_autograd_cache", None),
    # dtcompile.ranks.check: the backward compiled with the forward, the store, the cache folder
    ("torch._functorch.config", "force_non_lazy_backward_lowering", None),
    ("torch.distributed.distributed_c10d", "_get_default_store", ()),
    ("torch._inductor.runtime.cache_dir_utils", "cache_dir", ()),
    ("torch._guards", "CompileContext.current_compile_id", ()),
    ("torch._logging", "trace_structured", ("name", "metadata_fn", "payload_fn")),
    ("torch.distributed.distributed_c10d", "_resolve_process_group", None),  # a builtin: no signature
    ("torch.distributed._symmetric_memory", "enable_symm_mem_for_group", ("group_name",)),
    # dtcompile.auto_parallel: DTensor's strategies, sharding propagation and redistribution planner
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator", None),
    ("torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_non_cached", ("self", "op_schema")),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs", None),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs", None),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.op_to_schema_info", None),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.op_to_schema_info_for_single_dim_strategy", None),
    ("torch.distributed.tensor._op_schema", "OpSchema", ("op", "args_schema", "kwargs_schema", "schema_info")),
    ("torch.distributed.tensor._op_schema", "OpSchema.args_meta", None),
    ("torch.distributed.tensor._op_schema", "OpSchema.kwargs_meta", None),
    ("torch.distributed.tensor._op_schema", "OpSpec", ("output_specs", "input_specs", "redistribute_cost")),
    ("torch.distributed.tensor._op_schema", "OpStrategy", ("strategies",)),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec", ("mesh", "placements", "tensor_meta")),
    # dtcompile.auto_parallel.measure: a DTensor made from a fake shard and its spec, as DTensor's
    # own ops make their results (from_local's autograd function is a fifth of a measurement)
    ("torch.distributed.tensor", "DTensor.__new__", None),
    # dtcompile.base.bucket_ops: a reduce-scatter bucket's copy-in, FSDP2's (one kernel on CUDA)
    ("torch", "_chunk_cat", None),
    # dtcompile.auto_parallel.local_ops: the CPU flash attention borrows this op's strategies
    ("torch", "ops.aten._scaled_dot_product_efficient_attention", None),
    ("torch", "ops.aten._scaled_dot_product_efficient_attention.default", None),
    # dynamo_vars.dtensor_api: DTensor.__tensor_unflatten__ rebuilds the spec it was given
    ("torch.distributed.tensor", "DTensor.__tensor_unflatten__", ("inner_tensors", "flatten_spec", "outer_size", "outer_stride")),
    (
        "torch.distributed.tensor._dtensor_spec",
        "DTensorSpec",
        ("mesh", "placements", "tensor_meta", "shard_order", "use_strided_shard_as_shard_order"),
    ),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta", ("shape", "stride", "dtype")),
    ("torch.distributed.tensor._ops.single_dim_strategy", "_insert_single_dim_replication_strategy",
     ("single_dim_strategies_with_placeholders", "num_outputs", "num_input_tensors", "output_tensor_meta")),
    ("torch.distributed.tensor._ops.single_dim_strategy", "_fill_single_dim_strategy_placeholders",
     ("unique_input_placements", "single_dim_strategies_with_placeholders")),
    ("torch.distributed.tensor._ops.utils", "expand_to_full_mesh_op_strategy",
     ("mesh", "op_schema", "single_mesh_dim_strategies", "output_tensor_meta", "input_index", "allow_uneven_sharding")),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos", ("src_spec", "dst_spec")),
    # dtcompile.auto_parallel.expansion: DTensor's answers kept by what they read while a plan is built
    ("torch.distributed.tensor._collective_utils", "redistribute_cost", ("current_spec", "target_spec")),
    ("torch.distributed.tensor._ops.utils", "redistribute_cost", ("current_spec", "target_spec")),
    ("torch.distributed.tensor._ops.utils", "is_tensor_shardable", ("shape", "spec")),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec.is_default_device_order", ("shard_order",)),
    ("torch.distributed.tensor._redistribute", "_FORCE_MIN_COST_REDISTRIBUTION_PLAN", None),
    ("torch.distributed.tensor._redistribute", "_optimize_transform_infos",
     ("transform_infos", "device_mesh", "src_placements", "dst_placements")),
    ("torch.distributed.tensor._redistribute", "_TransformInfo", ("mesh_dim", "src_dst_placements", "logical_shape")),
    ("torch.distributed.tensor._redistribute", "_FlattenedTransformInfo", ("mesh", "original_mesh_dims")),
    ("torch.fx.experimental.proxy_tensor", "get_proxy_mode", ()),
    # dtcompile.auto_parallel.trace, dtcompile.step: the traced graph module writes its code only
    # when run or read (after the passes)
    ("torch.fx._lazy_graph_module", "_use_lazy_graph_module", ("should_use",)),
    # dtcompile.auto_parallel: an op without a strategy traced as its registered decomposition
    ("torch._decomp", "decomposition_table", None),
    ("torch._subclasses.fake_tensor", "FakeTensorMode", ("allow_non_fake_inputs",)),
    # dtcompile.passes._graph.refresh_metadata: a layout node's fake value read off its meta kernel
    ("torch._subclasses.fake_tensor", "FakeTensor", None),
    ("torch._subclasses.fake_tensor", "in_kernel_invocation_manager", ("fake_mode",)),
    ("torch._subclasses.fake_tensor", "FakeTensorConverter.from_meta_and_device", ("self", "fake_mode", "t", "device")),
    ("torch._C", "_DisablePythonDispatcher", None),
    # dtcompile.pipeline.step_reads.scalars_once: make_fx's symbolic scalar arithmetic, traced through
    # its proxy mode's __sym_dispatch__ (handle_sym_dispatch calls it by name)
    ("torch.fx.experimental.proxy_tensor", "ProxyTorchDispatchMode.__sym_dispatch__",
     ("self", "func", "types", "args", "kwargs")),
    # dtcompile.pipeline.stack_traces: the frames make_fx keeps of a node's stack, by torch's own rule
    ("torch.fx.proxy", "_STACK_TRACE_ANCHORS", None),
    # dtcompile._testing.moe: the MoE's token dispatch (differentiable, as torchtitan's)
    ("torch.distributed._functional_collectives", "all_to_all_single", ("self", "output_split_sizes", "input_split_sizes", "group")),
    # dtcompile.base.torch_compat.frame_compile_started_ns: when Dynamo began compiling the frame
    # (the context's _start_time_ns is an instance attribute, read with getattr: a stage not timed where gone)
    ("torch._dynamo.utils", "get_metrics_context", ()),
    ("torch._dynamo.metrics_context", "MetricsContext.in_progress", ("self",)),
    # dtcompile.base.torch_compat.deferred_full_gc: torch's compile defers full collections (2.15 on)
    ("torch._dynamo.utils", "deferred_full_gc", (), _FROM_2_15),
    # dtcompile.base.torch_compat: the version differences' own probes
    ("torch._dynamo.exc", "TorchRuntimeError", None),
    ("torch._functorch._aot_autograd.schemas", "SubclassCreationMeta", None),
    # graph facts and passes: op and collective kinds, pytrees
    ("torch._ops", "OpOverload", None),
    ("torch._ops", "OpOverloadPacket", None),
    ("torch", "ops._c10d_functional.wait_tensor.default", None),
    ("torch", "ops._c10d_functional.all_gather_into_tensor.default", None),
    # dtcompile.step: the training step traced as one graph (forward, backward, optimizer)
    ("torch._guards", "TracingContext", None),
    ("torch._guards", "tracing", ("context",)),
    ("torch._subclasses.fake_tensor", "DataDependentOutputException", None),
    ("torch._subclasses.fake_tensor", "DynamicOutputShapeException", None),
    ("torch.nn.utils.stateless", "_reparametrize_module", ("module", "parameters_and_buffers")),
    # dtcompile.pipeline.step_reads: the optimizer's step counts read once (what .item() runs)
    ("torch", "ops.aten._local_scalar_dense", None),
    ("torch", "ops.aten._local_scalar_dense.default", None),
    # dtcompile.testing.memory: a subclass's inner tensors hold its bytes
    ("torch.utils._python_dispatch", "is_traceable_wrapper_subclass", ("t",)),
    ("torch.distributed.distributed_c10d", "_get_default_group", ()),
    ("torch.distributed._functional_collectives", "AsyncCollectiveTensor", None),
    ("torch.distributed._functional_collectives", "broadcast", ("self", "src", "group")),
    ("torch.distributed._symmetric_memory", "get_symm_mem_workspace", ("group_name", "min_size")),
    ("torch.distributed.tensor.placement_types", "_StridedShard", None),
    ("torch.distributed.tensor._utils", "normalize_to_torch_size", ("size",)),
    ("torch._prims_common", "make_contiguous_strides_for", ("shape",)),
    ("torch.utils._pytree", "keystr", ("kp",)),
    ("torch.utils._pytree", "tree_flatten", ("tree", "is_leaf")),
    ("torch.utils._pytree", "tree_flatten_with_path", ("tree", "is_leaf")),
    ("torch.utils._pytree", "tree_leaves", ("tree", "is_leaf")),
    ("torch.utils._pytree", "tree_map", ("func", "tree")),
    ("torch.utils._pytree", "tree_map_only", ("type_or_types_or_pred", "func", "tree")),
    ("torch.utils._pytree", "tree_unflatten", ("leaves", "treespec")),
    ("torch.utils._python_dispatch", "TorchDispatchMode", None),
    # hops: the op's dispatch keys
    ("torch._C", "DispatchKey.Autograd", None),
    ("torch._C", "DispatchKey.CompositeExplicitAutograd", None),
    # dynamo_vars: trackers, graph breaks, DTensor state read and set in compiled code
    ("torch._dynamo.exc", "Unsupported", None),
    ("torch._dynamo.bytecode_transformation", "create_call_function", ("nargs", "push_null")),
    ("torch._dynamo.variables.base", "VariableTracker.build", ("tx", "value", "source")),
    ("torch._dynamo.variables.constant", "ConstantVariable.create", ("value",)),
    ("torch._dynamo.variables.ctx_manager", "ContextWrappingVariable._nonvar_fields", None),
    ("torch._dynamo.variables.functions", "UserFunctionVariable", None),
    ("torch._dynamo.variables.lists", "BaseListVariable", None),
    ("torch._dynamo.variables.lists", "ListVariable", None),
    ("torch._dynamo.variables.lists", "TupleVariable", None),
    ("torch._dynamo.guards", "GuardBuilder.EQUALS_MATCH", ("self", "guard")),
    ("torch._dynamo.guards", "GuardBuilder.OPAQUE_OBJ_GUARD_FN_MATCH", ("self", "guard")),
    ("torch._C", "_get_dtensor_allow_implicit_replication", None),
    ("torch._C", "_set_dtensor_allow_implicit_replication", None),
    ("torch.distributed.tensor", "DTensor._op_dispatcher._custom_op_handlers", None),
    # the backend: AOTAutograd, Inductor's settings and modes
    ("torch._dynamo.backends.common", "aot_autograd", ()),
    ("torch._functorch.config", "patch", None),
    ("torch._inductor.config", "get_config_copy", ()),
    ("torch._inductor.config", "patch", None),
    ("torch._inductor", "list_mode_options", ("mode", "dynamic")),
    # dtcompile.report, dtcompile.testing: compile counts, recompile reasons, worlds of ranks
    ("torch._dynamo", "reset", ()),
    ("torch._dynamo.utils", "counters", None),
    ("torch._dynamo.utils", "guard_failures", None),
    ("torch._dynamo.testing", "CompileCounterWithBackend", ("backend",)),
    ("torch._dynamo.config", "patch", None),
    ("torch._dynamo.config", "recompile_limit", None),
    ("torch._dynamo.config", "accumulated_recompile_limit", None),
    ("torch._dynamo.exc", "InvalidBackend", None),
    ("torch._dynamo.backends.registry", "lookup_backend", ("compiler_fn",)),
    ("torch._C", "_distributed_c10d._set_thread_isolation_mode", None),
    ("torch.testing._internal.distributed.fake_pg", "FakeStore", None),
    ("torch.testing._internal.distributed.multi_threaded_pg", "ProcessLocalGroup.exception_handle", ("cls", "exc")),
    ("torch.testing._internal.distributed.multi_threaded_pg", "ProcessLocalGroup.reset", ("cls",)),
    ("torch.testing._internal.distributed.multi_threaded_pg", "ReduceScatter", None),
    ("torch.testing._internal.distributed.multi_threaded_pg", "_install_threaded_pg", ()),
    ("torch.testing._internal.distributed.multi_threaded_pg", "_uninstall_threaded_pg", ()),
    ("torch.testing._internal.distributed.multi_threaded_pg", "_reduce_ops", None),
    ("torch.utils._python_dispatch", "_is_in_torch_dispatch_mode", None),
    ("torch.utils._python_dispatch", "_is_in_non_infra_torch_dispatch_mode", None),
    ("torch.utils._python_dispatch", "_is_in_any_mode_without_ignore_compile_internals", None),
    ("torch.distributed._local_tensor", "local_tensor_mode", ()),
    ("torch.distributed._local_tensor", "maybe_disable_local_tensor_mode", ()),
    # dtcompile._testing.idioms_process_group: the functional collectives users call
    ("torch.distributed._functional_collectives", "all_gather_single", None),
    ("torch.distributed._functional_collectives", "all_gather_tensor", ("self", "gather_dim", "group")),
    ("torch.distributed._functional_collectives", "all_gather_tensor_autograd", ("self", "gather_dim", "group")),
    ("torch.distributed._functional_collectives", "all_reduce", ("self", "reduceOp", "group")),
    ("torch.distributed._functional_collectives", "reduce_scatter_tensor", ("self", "reduceOp", "scatter_dim", "group")),
))

PATCHED: tuple[PrivateName, ...] = tuple(_P(module, path, None, *versions) for module, path, *versions in (
    # dynamo_vars.placements, .device_mesh, .dtensor_api: readable guards
    ("torch._dynamo.guards", "GuardBuilder.EQUALS_MATCH"),
    ("torch._dynamo.guards", "GuardBuilder.OPAQUE_OBJ_GUARD_FN_MATCH"),
    ("torch._dynamo.guards", "GuardBuilder.DTENSOR_SPEC_MATCH"),
    # dynamo_vars.device_mesh: mesh._flatten() traced on the real mesh
    ("torch._dynamo.variables.script_object", "TorchScriptObjectVariable.call_method", _UNTIL_2_14),
    ("torch._dynamo.variables.script_object", "CustomClassObjectVariable.call_method", _FROM_2_14),
    # dynamo_vars.dtensor_api: DTensor method results, two-mesh errors explained, shard order kept
    ("torch._dynamo.variables.tensor", "TensorVariable.call_method"),
    ("torch._dynamo.utils", "_get_fake_value_impl"),
    ("torch.distributed.tensor", "DTensor.__tensor_unflatten__"),
))
"""Every torch object dynamo_vars replaces while installed (``dynamo_vars/_install.py``);
``uninstall()`` puts each original back."""



class Break(NamedTuple):
    """A listed name the running torch lacks, or has without what dtcompile relies on."""

    name: PrivateName
    problem: str
    """In words: ``gone``, ``lost the parameters ['hints'] dtcompile passes``..."""


class TorchContractError(RuntimeError):
    """The running torch lacks a private name a dtcompile feature relies on (:func:`require`)."""

    def __init__(self, message: str, breaks: tuple[Break, ...]) -> None:
        super().__init__(message)
        self.breaks = breaks


def resolve(name: PrivateName) -> Any:
    """The object ``name`` names on the running torch, unwrapped (a classmethod's function,
    the original under a ``functools.wraps`` wrapper); ``ImportError`` or ``AttributeError``
    where torch lacks it.  A class's attributes are read statically, as defined."""
    obj = importlib.import_module(name.module)
    for part in name.path.split("."):
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    return getattr(obj, "__wrapped__", obj)


def own_attribute(name: PrivateName) -> Any:
    """The object stored under ``name``'s last part in its owner's own namespace, as
    dynamo_vars replaces it (``vars(GuardBuilder)["EQUALS_MATCH"]``); ``KeyError`` where
    the owner only inherits it."""
    obj = importlib.import_module(name.module)
    *owners, last = name.path.split(".")
    for part in owners:
        obj = getattr(obj, part)
    return vars(obj)[last]


def problem(name: PrivateName) -> str | None:
    """What the running torch lacks of ``name``, in words; None where it has it with every
    parameter :attr:`PrivateName.params` lists."""
    try:
        obj = resolve(name)
    except Exception:  # a module or attribute gone, an op no longer registered: all one answer
        return "gone"
    if name.params is None:
        return None
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "has no signature to read"
    missing = [p for p in name.params if p not in signature.parameters]
    return f"lost the parameters {missing} dtcompile passes (now {signature})" if missing else None


_TORCH_TEST_HELPERS = "torch.testing._internal."
"""torch's own test helpers, used by dtcompile.testing's worlds only: importing one changes
the process (``multi_threaded_pg`` registers the ``threaded`` process-group backend)."""


def contract_breaks() -> list[Break]:
    """Every break of the contract on the running torch, in the contract's order: each
    :data:`PRIVATE_NAMES` entry that :func:`applies` and has a :func:`problem`, then each
    :data:`PATCHED` object no longer defined where dynamo_vars replaces it.

    What ``dynamo_vars.install()`` checks on a torch newer than :data:`TESTED_TORCH`; it
    imports every module listed (about a second past what a compile imports anyway) but
    torch's test helpers (``torch.testing._internal``), which it leaves out: those the
    contract test checks, and a world of dtcompile.testing imports them when it starts."""
    found = [
        Break(n, why)
        for n in PRIVATE_NAMES
        if applies(n) and not n.module.startswith(_TORCH_TEST_HELPERS) and (why := problem(n)) is not None
    ]
    broken = {b.name.dotted for b in found}
    for name in PATCHED:
        if not applies(name) or name.dotted in broken:
            continue
        try:
            own_attribute(name)
        except Exception:
            found.append(Break(name, "no longer defined on its owner, where dynamo_vars replaces it"))
    return found


def describe(breaks: Iterable[Break], shown: int = 3) -> str:
    """The first ``shown`` breaks, each with its problem, and how many more:
    ``torch._dynamo.guards.check_dtensor_spec (gone) and 2 more``."""
    breaks = list(breaks)
    text = ", ".join(f"{b.name.dotted} ({b.problem})" for b in breaks[:shown])
    return f"{text} and {len(breaks) - shown} more" if len(breaks) > shown else text


_required: dict[tuple[str, tuple[str, ...]], tuple[Break, ...]] = {}
""":func:`require`'s answers, per ``(feature, names)``: the breaks found, empty where the
names hold.  Kept for the process, as the running torch is."""


def require(names: Iterable[str], feature: str) -> None:
    """Raise :class:`TorchContractError` at ``feature``'s entry where the running torch
    breaks one of ``names`` (dotted, each listed in :data:`PRIVATE_NAMES`: every entry
    under it that :func:`applies` is checked, its parameters too).

    ``feature`` names what is refused (``dtcompile.auto_parallel``); the error names the
    broken names, the running torch and the tested range.  A name not listed is a
    ``ValueError``: the contract is the one list of private names.

    Cheap where a feature calls it on every use: the answer is kept per ``(feature,
    names)`` for the process (give ``names`` as a tuple, the feature's one tuple of
    them).  On a torch in :data:`TESTED_TORCH` the names are only looked up in the
    contract, not resolved: ``tests/architecture/test_torch_contract.py`` asserts every
    listed name with its parameters on each tested release, the same guarantee on which
    ``dynamo_vars.install()`` installs there without checking.  On any other torch each
    name is resolved once, with its parameters (:func:`problem`).
    """
    key = (feature, tuple(names))
    breaks = _required.get(key)
    if breaks is None:
        breaks = _required.setdefault(key, _feature_breaks(*key))
    if breaks:
        import torch

        (major, minor) = last_tested()
        raise TorchContractError(
            f"{feature}: torch {torch.__version__} lacks private torch names it relies on: {describe(breaks)}; "
            f"dtcompile is tested on torch {tested_range()} (the last tested release is {major}.{minor}): "
            f"install one of those (pip install 'torch{tested_range()}') or report it to dtcompile",
            breaks,
        )


def _feature_breaks(feature: str, names: tuple[str, ...]) -> tuple[Break, ...]:
    """What :func:`require` finds: ``ValueError`` for a name not listed, then the breaks
    of ``names`` on the running torch (none on a tested one, by the contract test)."""
    listed: dict[str, list[PrivateName]] = {}
    for name in PRIVATE_NAMES:
        listed.setdefault(name.dotted, []).append(name)
    unlisted = [dotted for dotted in names if dotted not in listed]
    if unlisted:
        raise ValueError(
            f"require: {feature} asks for {unlisted}, not in torch_contract.PRIVATE_NAMES; "
            "list each there, with the parameters it passes"
        )
    if torch_is_supported():
        return ()
    return tuple(
        Break(n, why) for dotted in names for n in listed[dotted] if applies(n) and (why := problem(n)) is not None
    )
