"""Every difference between the torch releases dtcompile supports, named once.

dtcompile supports torch 2.13, 2.14 and 2.15
(:data:`dtcompile.base.torch_contract.TESTED_TORCH`).  Where a private torch name or
a behaviour dtcompile relies on changed between them, one function or constant
here answers for the running torch, and its docstring names the change and the
versions on each side.  The rest of the code calls these; it never compares
``torch.__version__`` itself.  Feature detection (does the attribute exist?)
comes first; a version is compared, as a version, only where nothing can be
detected.  :data:`dtcompile.base.torch_contract.PRIVATE_NAMES` lists the names on
each side of a change with the versions that have them, and
``tests/architecture/test_torch_contract.py`` checks them on the running torch.

Private state read only to report on a compile (when Dynamo began compiling a frame:
:func:`frame_compile_started_ns`) is read here too, where a release that lacks it means
something not reported, never an error.

Dropping the oldest release deletes its branch here, in the same change.

Bottom layer: imports nothing of dtcompile's, and torch only inside functions.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = [
    "INDUCTOR_SIMPLE_OVERLAP",
    "compiled_blocks_recompile_for_async_outputs",
    "deferred_full_gc",
    "dot_of_partials_reduce_scatters",
    "fake_tensor_call_errors",
    "frame_compile_started_ns",
    "inductor_reorders_collectives",
    "script_object_variable",
    "subclass_outer_size_from_inner",
    "torch_version",
    "variable_getattr",
]


def torch_version() -> tuple[int, int]:
    """The running torch's ``(major, minor)``, parsed as a version (``2.15.0+cu132`` -> ``(2, 15)``)."""
    import torch
    from torch.torch_version import Version

    parsed = Version(torch.__version__)
    return (parsed.major, parsed.minor)


def script_object_variable() -> type[Any]:
    """Dynamo's tracker for script and opaque objects (a ``DeviceMesh`` is one).

    - torch 2.13: ``torch._dynamo.variables.script_object.TorchScriptObjectVariable``.
    - torch 2.14 and 2.15: renamed ``CustomClassObjectVariable`` in the same
      module, with the same ``call_method(self, tx, name, args, kwargs)``
      (Dynamo's opaque-object rework, which also renamed ``var_getattr`` to
      ``tp_getattro_impl`` there).
    """
    from torch._dynamo.variables import script_object

    found = getattr(script_object, "CustomClassObjectVariable", None)
    return found if found is not None else script_object.TorchScriptObjectVariable


def fake_tensor_call_errors() -> tuple[type[BaseException], ...]:
    """The exceptions Dynamo raises, while tracing, for an op that fails on fake tensors.

    - torch 2.13: ``torch._dynamo.exc.TorchRuntimeError``, raised where the op runs.
    - torch 2.14 and 2.15: the op's ``RuntimeError`` is raised inside the traced
      program as an observed exception (so that user code can catch it):
      ``torch._dynamo.exc.FakeTensorObservedException``; only where nothing
      catches it does it become a ``TorchRuntimeError`` at the frame's top, and
      the failed node is erased from the graph, its arguments with it.
    """
    from torch._dynamo import exc

    observed = getattr(exc, "FakeTensorObservedException", None)
    return (exc.TorchRuntimeError,) if observed is None else (exc.TorchRuntimeError, observed)


def variable_getattr(variable: Any, tx: Any, name: str) -> Any:
    """``getattr(value, name)`` on a Dynamo ``VariableTracker``, traced.

    - torch 2.13: ``VariableTracker.var_getattr(tx, name)``.
    - torch 2.14 and 2.15: renamed ``tp_getattro_impl(tx, name)`` (Dynamo's
      object-protocol rework: attribute access follows CPython's ``tp_getattro``).
    """
    method = getattr(variable, "tp_getattro_impl", None) or variable.var_getattr
    return method(tx, name)


def subclass_outer_size_from_inner() -> bool:
    """Whether AOTAutograd reads a subclass input's outer size from an inner tensor.

    - torch 2.13: no; a DTensor input's outer size is its own (static where the
      spec's shape is).
    - torch 2.14 and 2.15: yes, where they are equal when traced
      (``SubclassCreationMeta.outer_size_from_attr``).  A ``Replicate`` DTensor
      whose local shard Dynamo made dynamic (automatic dynamic, after a recompile
      for other placements) then gets its size specialized in the middle of the
      trace, and a ``local_map`` region's output recorded as dynamic before that
      no longer matches the compiled graph ("expected between 3 and 4 wrapped
      outputs"): docs/limits.md says so, a strict xfail pins it.
    """
    from torch._functorch._aot_autograd.schemas import SubclassCreationMeta

    return "outer_size_from_attr" in SubclassCreationMeta.__dataclass_fields__


def dot_of_partials_reduce_scatters() -> bool:
    """Whether DTensor computes ``x @ x`` of a ``Partial`` vector by reduce-scattering each operand.

    - torch 2.13: yes: each operand is reduce-scattered to ``Shard(0)`` inside
      the op (uneven for a vector of 3 over 2 ranks, where the Dynamo graph
      shows no uneven DTensor), then the shards' dot products are summed.
    - torch 2.14 and 2.15: no: the operand is all-reduced once (DTensor's
      ``dot`` strategy was rewritten on single-dim strategies).

    Nothing exposes the strategy's choice before running it, so this compares
    versions.
    """
    return torch_version() < (2, 14)


INDUCTOR_SIMPLE_OVERLAP = "aten_distributed_optimizations.enable_simple_overlap"
"""Inductor's own comm/compute reordering in its scheduler, by its setting's dotted name."""


def inductor_reorders_collectives() -> bool:
    """Whether this Inductor has the ``simple_overlap`` scheduler pass (:data:`INDUCTOR_SIMPLE_OVERLAP`).

    - torch 2.13: no.
    - torch 2.14 and 2.15: yes, on by default (pytorch/pytorch#184235, #184240):
      it moves each collective earlier and each wait later by adjacent swaps that
      never raise peak memory, and never past another ``_CollectiveKernel``.  A
      collective inside a custom op (a ``FallbackKernel``, such as
      ``dtcompile::fused_all_gather_matmul``) is invisible to that rule
      (pytorch/pytorch#189454, open), so the pass can move a collective across it.
    """
    from torch._inductor import config

    return INDUCTOR_SIMPLE_OVERLAP in config.get_config_copy()


def compiled_blocks_recompile_for_async_outputs() -> bool:
    """Whether a compiled tensor-parallel block recompiles for the next block's input.

    - torch 2.13: yes, once: the first compiled block's output reaches the second
      block with its local shard an ``AsyncCollectiveTensor`` where the first block
      was traced on a plain tensor, and Dynamo's type guard on ``x._local_tensor``
      fails (seen on torchtitan's Llama3 under ``parallelize_llama``: 3 frames per
      rank, the loss and the block twice).
    - torch 2.14 and 2.15: no: one graph serves every block (2 frames per rank).

    Observed on the releases, not detectable beforehand: this compares versions.
    """
    return torch_version() < (2, 14)


def frame_compile_started_ns() -> int | None:
    """When Dynamo began compiling the frame this thread is compiling, in ``time.time_ns()``
    nanoseconds; ``None`` where no frame is being compiled (a backend called by hand) or
    torch does not say.

    torch keeps it in the thread's metrics context (``torch._dynamo.utils.get_metrics_context()``,
    a ``MetricsContext`` that ``convert_frame``'s ``_compile`` enters for the frame:
    ``in_progress()`` while it compiles, the start in ``_start_time_ns``, an attribute
    its ``__enter__`` sets, so the contract lists the function and the method only),
    the same in the context's first versions as in torch 2.15.  All three are private:
    one missing, or of another type, is a stage not timed, never an error.
    """
    try:
        from torch._dynamo.utils import get_metrics_context

        context = get_metrics_context()
        started = getattr(context, "_start_time_ns", None)
        if not context.in_progress():
            return None
    except Exception:  # a private name gone or changed: Dynamo's seconds are not known
        return None
    return started if isinstance(started, int) and started > 0 else None


def deferred_full_gc() -> contextlib.AbstractContextManager[None]:
    """Full garbage collections deferred while dtcompile compiles outside Dynamo
    (``compile_step``'s trace, passes and lowering), as torch defers them while it
    compiles a frame.

    A full collection walks every object the process tracks, and a compile makes them
    by the hundred thousand (FX nodes, fake tensors, records): a 64-layer step collected
    the whole heap several times over its passes.  torch 2.15 raises the
    generation-2 threshold around each frame's compile and AOTAutograd's backward
    (``torch._dynamo.utils.deferred_full_gc``, under
    ``torch._dynamo.config.gc_gen2_threshold_during_compile``): this is torch's own
    context, so that it keeps one count of the compiles in progress on every thread, and
    restores the thresholds after the last.  Before 2.15 torch defers nothing, and
    neither does this.
    """
    if torch_version() < (2, 15):
        return contextlib.nullcontext()
    from torch._dynamo.utils import deferred_full_gc as deferred

    return deferred()
