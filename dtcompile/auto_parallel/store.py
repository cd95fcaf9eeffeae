"""Measurements kept on disk: a job that plans again (its next start, another rank, the next run of a
test suite) reads what an earlier process measured instead of asking DTensor again.

Measuring is most of a cold plan's time (DTensor expands an op's strategies for every
layout a candidate hands it; :mod:`~dtcompile.auto_parallel.measure`), and a measurement
depends only on what its key names, so it can be kept as Inductor keeps compiled
kernels.  One file per *table*: the measurements (and failures, and priced transfers)
made on meshes like one mesh under one cost profile (the table's key: device, shape, axis
names, ranks, flattenings, profile), for one torch and one planner (``torch.__version__``
and a hash of the source of the modules a measurement or a price comes from).  Another
torch, another dtcompile, or an edited cost model reads another file: nothing stale is
served.  An entry's key is the ``repr`` of the in-memory key (the op, its arguments,
shapes, dtypes, layouts); the values are the same frozen dataclasses, pickled.

Where: ``$DTCOMPILE_AUTO_PARALLEL_CACHE_DIR``, else ``~/.cache/dtcompile/auto_parallel``;
``DTCOMPILE_AUTO_PARALLEL_CACHE_DIR=0`` turns it off.  A file is written whole (a
temporary, then renamed), merged with what another process wrote meanwhile, after a plan
that measured something new; one that cannot be read is ignored (and replaced).  A file's
name starts with its planner version; writing one removes the store's files of other
versions (and temporaries left by a process that died) not written for
:data:`KEEP_OTHER_VERSIONS_S`: an upgrade of torch or dtcompile, or an edit of the planner,
leaves the old files behind only while a job on the old version may still read them.
Only files named as the store names them are removed.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import threading
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

__all__ = ["KEEP_OTHER_VERSIONS_S", "Table", "store_dir"]

log = logging.getLogger(__name__)

_OFF = ("0", "off", "false", "")

# The modules a measurement, a candidate or a transfer's price comes from.
_SOURCES = ("auto_parallel", "cost", "graph")

KEEP_OTHER_VERSIONS_S = 30 * 24 * 3600
"""How long a file of another planner version is kept after it was last written (30 days)."""
# A table (``<version>-<table>.<part>.pkl``; before versions led the name, ``<table>.<part>.pkl``),
# or the temporary one is written through (``<name>.<pid>.<thread>.tmp``).
_OURS = re.compile(r"^(?:[0-9a-f]{16}-)?[0-9a-f]{24}\.[a-z]+(?:\.pkl|\.\d+\.\d+\.tmp)$")


def store_dir() -> Path | None:
    """Where tables are kept (``None``: not kept)."""
    configured = os.environ.get("DTCOMPILE_AUTO_PARALLEL_CACHE_DIR")
    if configured is not None:
        return None if configured.strip().lower() in _OFF else Path(configured)
    return Path.home() / ".cache" / "dtcompile" / "auto_parallel"


@functools.cache
def _planner_version() -> str:
    """torch's version and a hash of the planner's and cost model's source."""
    import torch

    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256(torch.__version__.encode())
    for name in _SOURCES:
        path = root / name
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(root).as_posix().encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


class Table(MutableMapping):
    """A dict of measurements by key, backed by one file: a key not measured in this process is
    looked up (by its ``repr``) in what the file held when the table was made."""

    def __init__(self, table_key: Any, part: str) -> None:
        self._memory: dict[Any, Any] = {}
        self._new: dict[Any, Any] = {}  # measured here, not yet written
        folder = store_dir()
        version = _planner_version()
        name = hashlib.sha256(repr((version, table_key)).encode()).hexdigest()[:24]
        self.path = None if folder is None else folder / f"{version}-{name}.{part}.pkl"
        self._disk = _read(self.path)  # repr(key) -> the pickled value, unpickled when asked for

    def __contains__(self, key: object) -> bool:
        return key in self._memory or (bool(self._disk) and repr(key) in self._disk)

    def __getitem__(self, key: Any) -> Any:
        if key in self._memory:
            return self._memory[key]
        text = repr(key) if self._disk else None
        if text is None or text not in self._disk:
            raise KeyError(key)
        value = self._memory[key] = pickle.loads(self._disk[text])
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self._memory[key] = value
        if self.path is not None:
            self._new[key] = value

    def __delitem__(self, key: Any) -> None:
        raise TypeError("measurements are not removed")

    def __iter__(self) -> Iterator[Any]:
        return iter(self._memory)

    def __len__(self) -> int:
        return len(self._memory)

    def save(self) -> None:
        """Write what this process measured, merged with what the file holds now."""
        if self.path is None or not self._new:
            return
        fresh = {repr(k): pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL) for k, v in self._new.items() if _plain(v)}
        merged = {**_read(self.path), **fresh}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # (ranks as threads)
            temporary.write_bytes(pickle.dumps(merged, protocol=pickle.HIGHEST_PROTOCOL))
            temporary.replace(self.path)
        except OSError as e:  # a read-only home: planning goes on, measuring again next time
            log.warning("auto_parallel: could not keep measurements in %s: %s", self.path, e)
            return
        self._disk = merged
        self._new = {}
        _prune(self.path.parent, _planner_version())


def _prune(folder: Path, version: str) -> None:
    """Remove the store's files in ``folder`` that are not of ``version`` and were not written for
    :data:`KEEP_OTHER_VERSIONS_S` (another process may be reading one: it is only gone for it)."""
    oldest = time.time() - KEEP_OTHER_VERSIONS_S
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(f"{version}-") or not _OURS.match(entry.name):
            continue
        try:
            if entry.stat().st_mtime < oldest:
                os.unlink(entry.path)
        except OSError:  # gone already, or not ours to remove
            continue


def _plain(value: Any) -> bool:
    """Whether ``value`` holds only what pickles back equal: placements of DTensor's plain kinds
    (not a ``Partial`` subclass carrying state, as an embedding's mask), numbers, strings,
    enums and the planner's frozen dataclasses of them."""
    return _plain_checker()(value)


@functools.cache
def _plain_checker() -> Any:
    """:func:`_plain`, with what it reads of torch imported once and each dataclass's fields
    listed once (a plan writes thousands of values: checked one by one, that took a tenth of
    a cold plan)."""
    import dataclasses
    import enum

    from torch.distributed.tensor import Partial, Placement, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    atoms = {bool, int, float, str, type(None), Shard, Replicate, Partial, _StridedShard}
    fields: dict[type, tuple[str, ...] | None] = {}  # a dataclass's field names; None: not one

    def plain(value: Any) -> bool:
        kind = type(value)
        if kind in atoms:
            return True
        if kind is tuple or kind is list:
            return all(map(plain, value))
        if isinstance(value, Placement):  # a subclass of the plain kinds, with state of its own
            return False
        if isinstance(value, (bool, int, float, str, enum.Enum)):
            return True
        if isinstance(value, (tuple, list)):
            return all(map(plain, value))
        if kind not in fields:
            fields[kind] = tuple(f.name for f in dataclasses.fields(value)) if dataclasses.is_dataclass(kind) else None
        names = fields[kind]
        return names is not None and all(plain(getattr(value, name)) for name in names)

    return plain


def _read(path: Path | None) -> dict[str, bytes]:
    if path is None or not path.exists():
        return {}
    try:
        found = pickle.loads(path.read_bytes())
    except Exception as e:  # a torn or foreign file: measured again, and rewritten
        log.warning("auto_parallel: ignoring unreadable measurements %s: %s", path, e)
        return {}
    return found if isinstance(found, dict) else {}
