"""What torch's compile caches key a dtcompile graph on, besides the graph.

torch has two caches a restarted job reads: AOTAutograd's (the Dynamo graph ->
its compiled forward and backward; on a hit nothing is traced, partitioned or
passed) and Inductor's FX graph cache (one partitioned graph, after
dtcompile's passes -> its generated code).  Both key on the graph, its inputs
and Inductor's config, which carries dtcompile's partitioner
(:class:`dtcompile.pipeline.partition.Partitioner`, whose ``uuid()`` is
:func:`compile_key`).  Two things make those keys right for dtcompile:

- :func:`compile_key`: what else decides the graphs dtcompile makes: its own
  source (the ``dtcompile``, ``dtcompile.hops`` and ``dynamo_vars`` packages), every
  :class:`~dtcompile.config.DTCompileConfig` field that changes a graph (its
  :meth:`~dtcompile.config.DTCompileConfig.key_field_names`, each field saying so
  where it is declared; not ``report`` and ``trace_pass_graphs``, what is shown;
  ``aot_cache``, whether a cache is read; ``eager_fallback``, what happens where
  nothing compiles; ``check_ranks`` and ``check_ranks_timeout_s``, whether and how
  long ranks compare what they compiled) and the cost profile's numbers
  (the overlap pass decides by them).  A change of any of them misses.
- :data:`stable_mesh_keys`: a graph that takes a ``DeviceMesh`` (an opaque
  input) pickles the mesh into both keys, and the mesh's state holds ``_hash``,
  Python's ``hash()`` of its layout, which differs from process to process: every
  restarted process missed (stock Inductor too).  While a dtcompile compile
  runs, a ``DeviceMesh`` pickles without that cached hash (``copyreg``; the
  mesh recomputes it on first use, so a mesh pickled meanwhile by anyone else
  loads the same), and the keys are the same in the next process.
- :func:`rank_position`: where this rank stands in every mesh the graph holds.
  AOTAutograd keys a Dynamo graph before it traces it, on what every rank
  shares (a DTensor input keys on its spec: mesh, placements, global shape),
  but the trace reads this rank's coordinates (DTensor slices this rank's chunk
  when it takes ``Replicate`` to ``Shard``, sizes an uneven shard, offsets its
  random numbers) and bakes them into the forward and backward as constants.
  Ranks share one cache folder (torch's default is per user, so per node): a
  key without the rank served one rank's backward to the others after a
  restart, with wrong gradients and no error (stock Inductor does the same,
  ``benchmarks/cross_rank_cache_repro.py``).  So a graph that holds a mesh keys
  on this rank's global rank and its coordinate on each of those meshes: a
  restarted rank, on any machine, gets the entry it wrote itself.  A graph that
  holds no mesh (plain tensors and functional collectives) reads no coordinate
  while it traces; what its Dynamo trace read of the rank is a constant in the
  Dynamo graph, already in the key, and its entry is shared by every rank.
"""

from __future__ import annotations

import copyreg
import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.utils._pytree as pytree
from torch import fx

from dtcompile.base.scoped_patch import ScopedPatch
from dtcompile.config import DTCompileConfig
from dtcompile.cost import HardwareProfile

__all__ = ["compile_key", "key_fields", "meshes_held", "profile_text", "rank_position", "source_digest", "stable_mesh_keys"]


@functools.cache
def source_digest() -> str:
    """One digest of the sources of the packages that trace and rewrite dtcompile's graphs."""
    import dtcompile.hops
    import dynamo_vars

    digest = hashlib.sha256()
    roots = (Path(__file__).parent, Path(dtcompile.hops.__file__).parent, Path(dynamo_vars.__file__).parent)
    for root in dict.fromkeys(roots):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def _canonical(value: Any) -> str:
    """``value`` as text that is the same in every process (sets and mappings sorted)."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_canonical(v) for v in value)) + "}"
    if hasattr(value, "items"):
        return "{" + ", ".join(f"{k!r}: {_canonical(v)}" for k, v in sorted(value.items())) + "}"
    return repr(value)


def key_fields(config: DTCompileConfig) -> dict[str, str]:
    """The options that change a compiled graph, by name, as text every process writes alike."""
    return {name: _canonical(getattr(config, name)) for name in DTCompileConfig.key_field_names()}


def profile_text(profile: HardwareProfile) -> str:
    """``profile``'s numbers as text every process writes alike."""
    return _canonical(profile.to_json())


def compile_key(
    config: DTCompileConfig,
    profile: HardwareProfile,
    position: str = "",
    input_types: Sequence[Mapping[str, str] | None] = (),
) -> str:
    """The text torch's caches key dtcompile's graphs on, besides the graph and Inductor's config;
    ``profile`` is the one the graph is priced with (``auto`` picks it per graph), ``position``
    this rank's place in the graph's meshes (:func:`rank_position`; empty: shared by all ranks),
    ``input_types`` the inputs' ``spmd_types`` types per mesh axis
    (:func:`dtcompile.spmd.inference.input_types`): a graph whose inputs are typed otherwise is
    compiled (and type-checked) again, never served a check made for other types."""
    fields = ", ".join(f"{name}={text}" for name, text in key_fields(config).items())
    key = f"dtcompile(source={source_digest()}, {fields}, profile={profile_text(profile)}"
    if any(types for types in input_types):
        typed = "; ".join("-" if not types else ",".join(f"{axis}:{t}" for axis, t in sorted(types.items())) for types in input_types)
        key += f", spmd_types=({typed})"
    return key + (f", rank={position})" if position else ")")


def meshes_held(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    """Every ``DeviceMesh`` the Dynamo graph holds, in order of appearance: its inputs', its
    nodes' values' and its nodes' constant arguments' (a DTensor's mesh, a spec's, a mesh)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    from dtcompile.base.notation import real_object

    values: list[Any] = list(example_inputs)
    for node in gm.graph.nodes:
        values += [node.meta.get("example_value"), node.args, node.kwargs]
    meshes: dict[int, Any] = {}
    for value in pytree.tree_leaves(values):
        value = real_object(value)
        if isinstance(value, (DTensor, DTensorSpec)):
            value = real_object(value.device_mesh if isinstance(value, DTensor) else value.mesh)
        if isinstance(value, DeviceMesh):
            meshes.setdefault(id(value), value)
    return list(meshes.values())


def rank_position(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """This rank's place in the meshes the Dynamo graph ``gm`` holds, for the cache keys:
    ``"3 of 4: DeviceMesh((dp=2, tp=2)) at (1, 1)"``; empty where it holds no mesh
    (its entry is then shared by every rank)."""
    import torch.distributed as dist

    from dtcompile.base.notation import describe_mesh

    meshes = meshes_held(gm, example_inputs)
    if not meshes:
        return ""
    where = ", ".join(f"{describe_mesh(mesh)} at {tuple(mesh.get_coordinate() or ())}" for mesh in meshes)
    if dist.is_available() and dist.is_initialized():
        return f"{dist.get_rank()} of {dist.get_world_size()}: {where}"
    return where


def _reduce_mesh(mesh: Any) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The mesh's own pickle (``__getstate__``) without ``_hash``, its cached ``hash()``."""
    state = mesh.__getstate__()
    state.pop("_hash", None)
    return copyreg.__newobj__, (type(mesh),), state


def _register_mesh_reducer() -> Callable[[], None]:
    from torch.distributed.device_mesh import DeviceMesh

    before = copyreg.dispatch_table.get(DeviceMesh)
    copyreg.dispatch_table[DeviceMesh] = _reduce_mesh

    def undo() -> None:
        if before is None:
            copyreg.dispatch_table.pop(DeviceMesh, None)
        else:
            copyreg.dispatch_table[DeviceMesh] = before

    return undo


stable_mesh_keys = ScopedPatch(_register_mesh_reducer)
"""``with stable_mesh_keys():`` a ``DeviceMesh`` pickles without its per-process hash."""
