"""Every change dtcompile makes outside its own objects, in one list: what, where, for how long.

A process that imports dtcompile, makes a backend or runs a test world has some of
torch's state changed: Dynamo's handler tables and guard builders, the partitioner's
rules, ``copyreg``'s table, DTensor's op handlers, torch's backend registry, Dynamo's
and Inductor's configs.  :data:`CHANGES` names each function that makes such a change
and says how long it lasts (:class:`Scope`): only while one call needs it, while
dynamo_vars is installed, on one thread, on an object the caller handed over, or for
the life of the process (then the entry says why that is safe).

``tests/architecture/test_process_changes.py`` reads the library's code for the forms
such a change takes (``setattr``/``delattr`` on another object, a write or a mutating
call through an imported object or one a function hands out, ``global``, ``copyreg``,
``ScopedPatch``, ``config.patch``, registrations with ``torch.library``, torch's
``_set_*``/``_install_*`` switches, ``gc.freeze``) and fails on a function that makes one and is not
listed here, and on an entry that no longer makes one.

Bottom layer: data only, imports nothing.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["CHANGES", "Change", "Scope"]


class Scope(str, enum.Enum):
    CALL = "call"
    """Undone when the call that made it returns (a ``with`` block, ``try``/``finally``, a
    :class:`~dtcompile.base.scoped_patch.ScopedPatch` held while any compile needs it)."""
    INSTALL = "install"
    """Made by ``dynamo_vars.install()`` (a backend being made); ``dynamo_vars.uninstall()``
    undoes it."""
    THREAD = "thread"
    """This thread's state only (grad mode, proxy modes, a ``threading.local``)."""
    OBJECT = "object"
    """An object the caller handed over (the model to parallelize, the graph module being
    compiled) or made itself; nothing shared."""
    PROCESS = "process"
    """For the life of the process; ``why`` says why that is safe."""


class Change(NamedTuple):
    module: str
    function: str
    """The function's qualified name in ``module`` (``<module>`` for import time)."""
    scope: Scope
    why: str
    """What it changes and how it is undone (or why it stays)."""


_C, _I, _T, _O, _P = Scope.CALL, Scope.INSTALL, Scope.THREAD, Scope.OBJECT, Scope.PROCESS

CHANGES: tuple[Change, ...] = tuple(Change(*entry) for entry in (
    # ---- the backend
    ("dtcompile.pipeline.graph_compile", "_aot_settings", _C,
     "functorch config (AOTAutograd's settings for this graph) inside the backend call only"),
    ("dtcompile.pipeline.graph_compile", "GraphCompile._inductor_inner.lowering", _C,
     "Inductor's config: its own comm reordering off where dtcompile's passes own the schedule, "
     "for this lowering only"),
    ("dtcompile.pipeline.recompute", "partition_at", _C,
     "functorch's activation_memory_budget while one partition runs"),
    ("dtcompile.pipeline.partition", "_install_keeping_rules", _C,
     "the partitioner's is_not_collective and _must_be_in_forward, while a partition that keeps "
     "collectives runs (ScopedPatch: held while any thread needs it, the originals put back)"),
    ("dtcompile.pipeline.partition", "_install_keeping_rules.undo", _C, "puts the partitioner's rules back"),
    ("dtcompile.pipeline.partition", "<module>", _C, "the ScopedPatch above; nothing happens at import"),
    ("dtcompile.cache_keys", "_register_mesh_reducer", _C,
     "copyreg's reducer for DeviceMesh (pickled without its per-process hash) while a compile "
     "computes its cache key (ScopedPatch)"),
    ("dtcompile.cache_keys", "_register_mesh_reducer.undo", _C, "puts copyreg's entry back as it was"),
    ("dtcompile.cache_keys", "<module>", _C, "the ScopedPatch above; nothing happens at import"),
    ("dtcompile.auto_parallel.api", "_freeze_heap", _C,
     "the garbage collector's generations: the objects made before a plan frozen (gc.freeze) while "
     "some thread plans, unless the process froze its own (ScopedPatch)"),
    ("dtcompile.auto_parallel.api", "<module>", _C, "the ScopedPatch above; nothing happens at import"),
    ("dtcompile.auto_parallel.expansion", "_keep_expansions", _C,
     "DTensor's expand_to_full_mesh_op_strategy, the redistribute_cost its strategy functions call "
     "(module attributes of _ops.utils), _redistribute._gen_transform_infos, and its sharding propagator's "
     "_propagate_tensor_meta_non_cached (an attribute of that one object) replaced by kept versions that "
     "answer as DTensor does, while a plan is being built (ScopedPatch)"),
    ("dtcompile.auto_parallel.expansion", "_keep_expansions.undo", _C,
     "puts DTensor's functions back and removes the propagator's attribute"),
    ("dtcompile.auto_parallel.expansion", "<module>", _C, "the ScopedPatch above; nothing happens at import"),
    ("dtcompile.pipeline.lowering", "inline_regions", _O, "removes a region body from the graph module being lowered"),
    ("dtcompile.step", "_make_graph", _C,
     "autograd's engine runs the backward on the calling thread while compile_step traces the step "
     "(make_fx traces what that thread runs), for the trace only"),
    ("dtcompile.base.fused_ops", "<module>", _P,
     "defines dtcompile::fused_all_gather_matmul and dtcompile::fused_matmul_reduce_scatter in "
     "torch.library: new names in our own namespace, changing no existing op"),
    ("dtcompile.base.bucket_ops", "<module>", _P,
     "defines dtcompile::pack_columns and dtcompile::unpack_columns in torch.library: new names in "
     "our own namespace, changing no existing op"),
    ("dtcompile.base.fused_ops", "_enable_symm_mem", _P,
     "enables symmetric memory for a process group before a fused op first runs on it, as torch's "
     "own async-TP pass does; only for groups a fused op runs on"),
    ("dtcompile.ranks.check", "abort_checks", _P,
     "writes the abort key in the job's store so that ranks waiting at a check stop: the job is "
     "ending with a failure"),
    ("dtcompile.base.sharding_cache", "clear_sharding_caches", _P,
     "empties DTensor's sharding-propagation caches; they refill on demand, nothing is lost"),
    ("dtcompile.registry", "_forget_named", _I,
     "on uninstall, torch's registry forgets 'dtcompile' and gets its entry point back"),
    ("dtcompile.registry", "named_backend", _I,
     "the one default backend per process, and the entry point kept for _forget_named"),
    ("dtcompile.registry", "backend", _I, "installs dynamo_vars (see below)"),
    ("dtcompile.auto_parallel", "<module>", _P,
     "makes our own module dtcompile.auto_parallel callable (its class); no torch object"),
    ("dtcompile.auto_parallel.apply", "parallelize", _O, "the model given to parallelize gets its DTensor parameters"),
    ("dtcompile.integrations.torchtitan", "register", _P,
     "adds the 'dtcompile' pass pipeline to torchtitan graph_trainer's PASS_PIPELINE_REGISTRY, on "
     "importing dtcompile.integrations.torchtitan, as graph_trainer's register_pass_pipeline does: "
     "a new name; graph_trainer uses it only where its config names it"),
    # ---- dynamo_vars
    ("dynamo_vars._install", "install", _P,
     "dynamo_vars' own fence, kept for the process: on a torch newer than the tested range, the result "
     "of its one contract check (torch_contract.contract_breaks: what broke, or nothing), so that "
     "installing again after uninstall() checks nothing again; and whether it has warned, once per "
     "process, about a torch outside the tested range or a newer one that breaks the contract. No torch "
     "object changes; the running torch, which the result describes, is the process's"),
    ("dynamo_vars._install", "_install_locked", _I,
     "Dynamo's _id_dispatch handlers, guard builders, opaque-type members and the objects in "
     "torch_contract.PATCHED (DTensor.__tensor_unflatten__ among them: it differs from stock only where "
     "stock raises, so other backends see no change); each undone by uninstall()"),
    ("dynamo_vars.dtensor_state", "set_implicit_replication", _T,
     "DTensor's implicit replication, as the user's implicit_replication() block sets it (a graph "
     "call that sets and resets it as eager does)"),
    ("dynamo_vars.dtensor_state", "set_loss_parallel", _C,
     "loss_parallel's DTensor op handlers, as the user's loss_parallel() block installs and removes them"),
    ("dynamo_vars.dtensor_state", "_keep_backward_handlers.undo", _C,
     "puts loss_parallel's backward handlers back as the first joint trace that kept them found "
     "them, when the last one ends (ScopedPatch: counted across threads)"),
    ("dynamo_vars.dtensor_state", "<module>", _C, "the ScopedPatch above; nothing happens at import"),
    # ---- hops
    ("dtcompile.hops.region_op", "_swapped_state", _T, "the region op's per-thread switches (a threading.local)"),
    ("dtcompile.hops.region_op", "<module>", _P,
     "registers the local_map_region HOP's fake implementation: our own op"),
    ("dtcompile.hops.region_op", "_proxy", _T, "proxy modes off while one region is traced (a with block)"),
    ("dtcompile.hops.joint", "_trace_joint", _T, "grad mode on while a region's joint graph is traced (a with block)"),
    ("dtcompile.hops.joint", "_trace_joint.joint", _T, "grad mode on inside the joint function (a with block)"),
    # ---- dtcompile.testing: the worlds users' CI runs in
    ("dtcompile.testing.worlds", "run_threaded", _C,
     "torch's threaded process group installed, thread isolation on, a reduce-scatter that keeps "
     "its input, a ShardingPropagator lock per world, DTensor's caches emptied and torch._dynamo.reset "
     "refusing on the rank threads; all undone in finally"),
    ("dtcompile.testing.worlds", "run_threaded.rank_main", _C, "Dynamo's recompile limits, per run"),
    ("dtcompile.testing.worlds", "_dispatch_mode_flags_kept", _C,
     "torch's process-wide \"a dispatch mode is active\" flags (torch.utils._python_dispatch), put "
     "back after a threaded world as the calling thread had them: rank threads in modes at once "
     "leave them set"),
    ("dtcompile.testing.worlds", "_gloo_rank_main", _P,
     "the environment of the spawned rank process itself (its rendezvous address)"),
    ("dtcompile.testing.memory", "measure_memory", _C, "garbage collection off while one step is measured"),
    # ---- dtcompile._testing: our tests' and benchmarks' models and corpus
    ("dtcompile._testing.data_parallel", "_data_parallel", _O,
     "the test model's parameters, sharded and parametrized in place"),
    ("dtcompile._testing.moe", "parallelize_moe", _O, "the test model's expert parameters, sharded and parametrized in place"),
    ("dtcompile._testing.idioms", "check_idiom", _P,
     "empties Dynamo's counters before an idiom is compiled, as torch._dynamo.reset() (called just "
     "before) leaves them; counts only"),
    ("dtcompile._testing.idioms", "corpus_failures", _C,
     "with stock=True, dtcompile's own sharding-cache clearing off while the corpus runs stock"),
    ("dtcompile._testing.pass_work", "counting_pass_work", _C,
     "the front doors' run_passes (graph_compile's and step_pass's names for it) wrapped to count "
     "the passes' work, inside the with block only; the trace function set around each call is put back"),
))
