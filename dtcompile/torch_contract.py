"""Which torch dtcompile is written for, and the private torch names it relies on.

dtcompile reaches into ~40 private names of torch (Dynamo's variable builder
and guard builder, the HOP tracing helpers, DTensor's sharding caches...).
Their contract is not public, so it is fenced:

- :data:`TESTED_TORCH` is the range of torch versions the package is tested
  on (``pyproject.toml`` pins the same range);
  :func:`torch_is_supported` says whether the running torch is in it, and
  ``dynamo_vars.install()`` leaves stock Dynamo alone with one warning outside it;
- :data:`PRIVATE_NAMES` lists every private name used, with the parameters
  dtcompile passes; ``tests/test_torch_contract.py`` asserts each still exists
  with that signature, so an upgrade that moves one fails in one readable test
  instead of silently (a guard that no longer explains itself, a region whose
  backward is paired wrongly).

Bottom layer: imports nothing of dtcompile's, and torch only inside functions.
"""

from __future__ import annotations

__all__ = ["PRIVATE_NAMES", "TESTED_TORCH", "torch_is_supported"]

TESTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 13), (2, 14))
"""``[low, high)``: the torch (major, minor) versions dtcompile is tested on."""


def torch_is_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the running torch's) is in :data:`TESTED_TORCH`."""
    from torch.torch_version import TorchVersion

    if version is None:
        import torch

        version = torch.__version__
    low, high = TESTED_TORCH
    # TorchVersion compares as a version (2.13.0+cpu >= (2, 13)), not as a string.
    parsed = TorchVersion(version)
    return parsed >= low and parsed < high


# (module, attribute path, parameter names the call sites rely on; None: not a
# callable we call, only its existence matters).  Kept in the order of the
# layers that use them.
PRIVATE_NAMES: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    # dtcompile.notation, dynamo_vars.guards
    ("torch._library.fake_class_registry", "FakeScriptObject", None),
    # dtcompile.sizes: sizes read without guarding
    ("torch.fx.experimental.symbolic_shapes", "optimization_hint", ("a", "fallback")),
    ("torch.fx.experimental.symbolic_shapes", "free_unbacked_symbols", ("x",)),
    # dtcompile.sharding_cache
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
    ("torch._dynamo.variables.script_object", "TorchScriptObjectVariable.call_method", ("self", "tx", "name", "args", "kwargs")),
    ("torch._subclasses.fake_tensor", "unset_fake_temporarily", ()),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten", ("self", "mesh_dim_name")),
    ("torch._dynamo.backends.registry", "_COMPILER_FNS", None),
    ("torch._dynamo.backends.registry", "_BACKENDS", None),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", None),
    ("torch.distributed.device_mesh", "_mesh_resources", None),
    ("torch.distributed.device_mesh", "DeviceMesh._get_root_mesh", ("self",)),
    # dtcompile.sharding_cache and the threaded world: per-rank plans, a shared fake mode
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
    # dynamo_vars.dtensor_api: DTensor.__tensor_unflatten__ rebuilds the spec it was given
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
    ("torch.distributed.tensor._redistribute", "_optimize_transform_infos",
     ("transform_infos", "device_mesh", "src_placements", "dst_placements")),
    ("torch.distributed.tensor._redistribute", "_TransformInfo", ("mesh_dim", "src_dst_placements", "logical_shape")),
    ("torch.distributed.tensor._redistribute", "_FlattenedTransformInfo", ("mesh", "original_mesh_dims")),
    ("torch.fx.experimental.proxy_tensor", "get_proxy_mode", ()),
    ("torch._subclasses.fake_tensor", "FakeTensorMode", ("allow_non_fake_inputs",)),
    # dtcompile._testing.models: the MoE's token dispatch (differentiable, as torchtitan's)
    ("torch.distributed._functional_collectives", "all_to_all_single", ("self", "output_split_sizes", "input_split_sizes", "group")),
)
