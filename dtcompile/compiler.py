"""The dtcompile ``torch.compile`` backend.

``backend(**options)`` returns a compiler function for ``torch.compile``; the
name ``"dtcompile"`` (registered through the ``torch_dynamo_backends`` entry
point) is that factory's result with default options.

The pipeline for one Dynamo graph:

1. AOTAutograd traces the joint forward/backward graph with Inductor's
   decomposition table, DTensor desugars to local ops plus functional
   collectives, and the min-cut partitioner splits it into a forward and a
   backward graph (exactly the graphs Inductor would get).
   ``local_map`` regions stay one ``local_map_region`` node each, forward and
   backward (:func:`hops.keep_regions` is on while AOTAutograd traces).
2. :func:`dtcompile.passes.run_passes` runs the ordered pass list on each.
3. Lowering: the regions are inlined (:func:`dtcompile.regions.inline_regions`),
   then Inductor's ``compile_fx_inner`` (``inductor=True``), or the graph as
   it is (``inductor=False``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

import dynamo_vars
from hops import keep_regions
from dtcompile.annotations import (
    DynamoGraphInfo,
    describe_dynamo_graph,
    format_aot_graph,
)
from dtcompile.collectives import CollectiveInfo, graph_collectives, mesh_axes
from dtcompile.config import DTCompileConfig
from dtcompile.cost_model import get_profile
from dtcompile.passes import PassRecord, run_passes
from dtcompile.regions import RegionInfo, format_with_regions, inline_regions, is_region
from dtcompile.report import emit_artifacts, format_compiled_graph

__all__ = ["CompiledGraph", "DTCompileBackend", "backend", "dtcompile"]

log = logging.getLogger(__name__)

# How many compiled graphs a backend keeps for inspection; older ones are dropped.
_MAX_RECORDS = 256


@dataclass(frozen=True)
class CompiledGraph:
    """What dtcompile did with one AOT graph (forward, backward or inference)."""

    compile_id: str
    """Dynamo's compile id, e.g. ``"0/0"`` (frame 0, first compile)."""
    kind: str
    """``forward``, ``backward`` or ``inference``."""
    graph: fx.GraphModule
    """The graph after the passes and with its regions inlined, as handed to lowering."""
    collectives: tuple[CollectiveInfo, ...]
    passes: tuple[PassRecord, ...]
    info: DynamoGraphInfo
    """The Dynamo graph it came from: placements, and collectives charged to its nodes."""
    regions: tuple[RegionInfo, ...] = ()
    """The ``local_map`` regions the passes saw as one op each (inlined at lowering)."""
    with_regions: str = ""
    """The graph as the passes left it, regions as one op (:func:`~dtcompile.regions.format_with_regions`);
    empty when it has none."""

    def annotated(self) -> str:
        """The graph one line per call node with its annotation (see :mod:`dtcompile.annotations`)."""
        return format_aot_graph(self.graph)


@contextlib.contextmanager
def _fresh_sharding_caches() -> Iterator[None]:
    """DTensor's sharding caches, empty before AOTAutograd and emptied after it.

    AOTAutograd runs DTensor ops on inputs whose mesh is a trace-time fake; those
    land in DTensor's caches, which compare meshes by ``==``, and a later hit gave
    compiled gradients and eager results the fake (or an earlier, equal mesh).
    """
    from dynamo_vars.dtensor_api import clear_sharding_caches

    clear_sharding_caches()
    try:
        yield
    finally:
        clear_sharding_caches()


class DTCompileBackend:
    """The compiler function ``torch.compile`` calls; made by :func:`backend`.

    ``records`` holds a :class:`CompiledGraph` for each graph it compiled
    (bounded; the newest last).
    """

    def __init__(self, config: DTCompileConfig) -> None:
        self.config = config
        self.records: collections.deque[CompiledGraph] = collections.deque(maxlen=_MAX_RECORDS)

    def __repr__(self) -> str:
        return f"dtcompile.backend({self.config})"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._functorch import config as functorch_config

        # The AOTAutograd cache keys on the Dynamo graph and global configs, not on
        # this backend's options and passes: a hit could return a graph compiled
        # without them.  Inductor's per-graph FX cache (keyed on the graph after
        # our passes) stays on.
        compile_id = torch._guards.CompileContext.current_compile_id()
        info = describe_dynamo_graph(
            gm,
            str(compile_id) if compile_id is not None else "?",
            mesh_axes(gm, example_inputs),
            get_profile(self.config.cost_profile),
        )
        with functorch_config.patch(enable_autograd_cache=False), _fresh_sharding_caches(), keep_regions():
            if self.config.inductor:
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(
                    gm,
                    example_inputs,
                    inner_compile=functools.partial(self._inductor_inner_compile, info),
                    config_patches=dict(self.config.inductor_config) or None,
                )
            return self._aot_without_inductor(gm, example_inputs, info)

    def _inductor_inner_compile(
        self,
        info: DynamoGraphInfo,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        **kwargs: Any,
    ) -> Any:
        from torch._inductor.compile_fx import compile_fx_inner

        if kwargs.get("is_backward"):
            kind = "backward"
        elif kwargs.get("is_inference"):
            kind = "inference"
        else:
            kind = "forward"
        gm = self._run_passes(gm, example_inputs, kind, info)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def _aot_without_inductor(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], info: DynamoGraphInfo
    ) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.compile_fx import select_decomp_table

        def compiler(kind: str) -> Callable[..., Any]:
            def compile_graph(graph: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
                from torch._functorch.aot_autograd import make_boxed_func

                return make_boxed_func(self._run_passes(graph, inputs, kind, info).forward)

            return compile_graph

        return aot_autograd(
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            decompositions=select_decomp_table(),
            partition_fn=functools.partial(
                min_cut_rematerialization_partition, compiler="inductor"
            ),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def _run_passes(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], kind: str, info: DynamoGraphInfo
    ) -> fx.GraphModule:
        gm.meta["dtcompile_graph_kind"] = kind
        gm.meta["dtcompile_mesh_axes"] = info.axes
        gm.meta["dtcompile_graph_info"] = info
        gm, passes = run_passes(gm, example_inputs, self.config)
        with_regions = format_with_regions(gm) if any(is_region(n) for n in gm.graph.nodes) else ""
        regions = inline_regions(gm, info)
        gm.recompile()
        record = CompiledGraph(
            compile_id=info.compile_id,
            kind=kind,
            graph=gm,
            collectives=tuple(graph_collectives(gm.graph, info.axes)),
            passes=tuple(passes),
            info=info,
            regions=tuple(regions),
            with_regions=with_regions,
        )
        self.records.append(record)
        log.info(
            "compile %s %s graph: %d nodes, %d collectives, %d local_map regions",
            record.compile_id,
            kind,
            len(gm.graph.nodes),
            len(record.collectives),
            len(regions),
        )
        for region in regions:
            log.info("compile %s %s graph: region %s", record.compile_id, kind, region)
        emit_artifacts(record)
        if self.config.report:
            print(format_compiled_graph(record), flush=True)
        return gm


def backend(**options: Any) -> DTCompileBackend:
    """Returns the dtcompile compiler function, configured by ``options``.

    ``options`` are the fields of :class:`DTCompileConfig`; an unknown name is a
    ``ValueError`` that lists the valid ones::

        model = torch.compile(model, backend=dtcompile.backend(inductor=False))

    Making a backend installs :mod:`dynamo_vars` into Dynamo (once per process),
    so that Dynamo traces the DTensor code before the backend sees it.
    """
    dynamo_vars.install()
    return DTCompileBackend(DTCompileConfig.from_options(options))


# What ``torch.compile(backend="dtcompile")`` resolves to (the entry point).
dtcompile = backend()
