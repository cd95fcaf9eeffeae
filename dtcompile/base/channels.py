"""The names that tie dtcompile's files together: node-meta keys, artifact names, graph kinds.

A pass writes what it learned of a node into ``node.meta``, the backend logs
what it compiled as ``TORCH_TRACE`` artifacts, and other files (the
annotations, lowering, the reports, ``dtcompile-report``, the tests) read them
back by name.  Every such name is defined here, once, so that a reader finds
who writes and who reads a channel by searching for its constant, and a typo is
an ``AttributeError``, not a silently empty channel (a test checks that no
other file spells one out).

- :class:`GraphKind`: which AOT graph (forward, backward, inference), or a whole step's;
- :class:`Meta`: the keys of ``node.meta`` dtcompile writes;
- :class:`Artifact`: the ``TORCH_TRACE`` artifact names, and :func:`parse_artifact`,
  the lookup table ``dtcompile-report`` reads them with;
- :class:`BesideCacheFolders`: the folders kept beside torch's compile cache (:mod:`dtcompile.base.beside_cache`).
"""

from __future__ import annotations

import enum

__all__ = ["Artifact", "BesideCacheFolders", "GraphKind", "Meta", "parse_artifact"]


class GraphKind(str, enum.Enum):
    """Which AOT graph AOTAutograd handed the backend, or a whole step's graph.  A ``str``: it prints, formats and
    serializes as its value (``forward``)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    INFERENCE = "inference"
    STEP = "step"
    """A whole training step traced as one graph (forward, loss and backward), as
    torchtitan's ``graph_trainer`` traces it (:mod:`dtcompile.integrations.torchtitan`)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Meta:
    """Keys of ``node.meta`` that dtcompile writes and reads."""

    COLLECTIVE = "dtcompile_collective"
    """A functional collective's :class:`~dtcompile.graph.collectives.CollectiveInfo` (the ``annotate`` pass)."""
    COST_US = "dtcompile_cost_us"
    """Its estimated time in microseconds under the graph's cost profile (``annotate``)."""
    SOURCE = "dtcompile_source"
    """The DTensor op of the Dynamo graph an AOT node comes from (``annotate``)."""
    ANNOTATION = "dtcompile_annotation"
    """The node's one-line annotation, as the reports print it (``annotate``; lowering keeps it)."""
    SPMD_TYPE = "dtcompile_spmd_type"
    """A plain tensor's SPMD type per mesh axis name, ``{"tp": "S(0)"}`` (:mod:`dtcompile.spmd.inference`)."""
    BUCKET = "dtcompile_bucket"
    """The collectives a bucket's copies stand for (``bucketing``)."""
    REGION = "dtcompile_region"
    """On nodes spliced in from a ``local_map`` region: the region node's name (lowering)."""
    REGION_CALL = "dtcompile_region_call"
    """In ``node.meta["custom"]``: which call of a ``local_map`` region a node belongs to (:mod:`dtcompile.hops`)."""
    OPTIMIZER = "dtcompile_optimizer"
    """In ``node.meta["custom"]``: the node is part of an optimizer's step traced into a whole-step graph (:mod:`dtcompile.step`)."""
    AUTOPARALLEL_REGION = "dtcompile_autoparallel_region"
    """On auto-parallel's traced graph: the fixed ``local_map`` region a node is in."""
    AUTOPARALLEL_REGION_ARGS = "dtcompile_autoparallel_region_args"
    """On auto-parallel's traced graph: the region's argument nodes."""
    AUTOPARALLEL_RESTACK = "dtcompile_autoparallel_restack"
    """In an auto-parallel trace's ``GraphModule.meta``: traces the model again with stack traces,
    for a message that names a node's source line (:func:`dtcompile.auto_parallel.trace.source_line`)."""


class Artifact:
    """Names of the ``TORCH_TRACE`` artifacts dtcompile logs (``tlparse`` and ``dtcompile-report`` read them)."""

    PLACEMENTS = "dtcompile_placements"
    """A Dynamo graph's DTensor placements, in op-schema notation."""
    EAGER_FALLBACK = "dtcompile_eager_fallback"
    """A Dynamo graph run eagerly: why, and the graph."""
    CACHED_COMPILE = "dtcompile_cached_compile"
    """A Dynamo graph AOTAutograd's cache served."""
    AUTO_PARALLEL_SOLUTION = "dtcompile_auto_parallel_solution"
    """An auto-parallel plan's ``explain()``."""

    @staticmethod
    def graph(kind: GraphKind) -> str:
        """An AOT graph, one annotated line per node."""
        return f"dtcompile_{GraphKind(kind).value}_graph"

    @staticmethod
    def collectives(kind: GraphKind) -> str:
        """An AOT graph's collectives, passes, memory and timeline (JSON)."""
        return f"dtcompile_{GraphKind(kind).value}_collectives"

    @staticmethod
    def regions(kind: GraphKind) -> str:
        """An AOT graph with its ``local_map`` regions as one op each."""
        return f"dtcompile_{GraphKind(kind).value}_regions"

    @staticmethod
    def compile_seconds(kind: GraphKind) -> str:
        """An AOT graph's compile seconds per stage (JSON, :class:`dtcompile.records.StageSeconds`),
        logged once its stages are done, and again where a later one adds to them (the last one counts)."""
        return f"dtcompile_{GraphKind(kind).value}_compile_seconds"

    @staticmethod
    def pass_graph(kind: GraphKind, when: str, pass_name: str) -> str:
        """An AOT graph ``before`` or ``after`` one pass (``trace_pass_graphs=True``)."""
        return f"dtcompile_{GraphKind(kind).value}_{when}_{pass_name}"


# Artifact name -> (what it is, the graph kind it is of, or None).
_BY_NAME: dict[str, tuple[str, GraphKind | None]] = {
    Artifact.PLACEMENTS: ("placements", None),
    Artifact.EAGER_FALLBACK: ("eager_fallback", None),
    Artifact.CACHED_COMPILE: ("cached_compile", None),
    Artifact.AUTO_PARALLEL_SOLUTION: ("auto_parallel_solution", None),
    **{Artifact.graph(k): ("graph", k) for k in GraphKind},
    **{Artifact.collectives(k): ("collectives", k) for k in GraphKind},
    **{Artifact.regions(k): ("regions", k) for k in GraphKind},
    **{Artifact.compile_seconds(k): ("compile_seconds", k) for k in GraphKind},
}


def parse_artifact(name: str) -> tuple[str, GraphKind | None] | None:
    """What an artifact named ``name`` is: ``("graph", GraphKind.FORWARD)`` for
    ``dtcompile_forward_graph``, ``("placements", None)``...; ``None`` for a name that is
    not one of dtcompile's (torch's own, or a pass graph of ``trace_pass_graphs``)."""
    return _BY_NAME.get(name)


class BesideCacheFolders:
    """Folders dtcompile keeps beside torch's compile cache (:mod:`dtcompile.base.beside_cache`)."""

    SCHEDULES = "dtcompile_schedules"
    """Each compiled graph's collectives, for the ranks' check of a run the cache serves."""
    REPORTS = "dtcompile_reports"
    """Each compiled graph's artifacts, logged again when the cache serves it."""
    SPMD_TYPES = "dtcompile_spmd_types"
    """Each compiled graph's outputs' SPMD types, stamped on them when the cache serves it."""
