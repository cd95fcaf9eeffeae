"""What dtcompile keeps beside torch's compile cache for each graph it compiled there.

AOTAutograd's cache serves a graph without tracing it, so nothing of what
dtcompile decided is known in a run the cache serves.  The run that compiled
it keeps that beside the cache, one JSON file per graph, in a folder of
``cache_dir()`` (``TORCHINDUCTOR_CACHE_DIR``), named by a digest of the
graph's key (its compile key, Dynamo code and inputs):

- ``dtcompile_schedules/``: its collectives, which the ranks' check compares
  (:mod:`dtcompile.ranks.check`);
- ``dtcompile_reports/``: its ``TORCH_TRACE`` artifacts (:mod:`dtcompile.artifacts`),
  logged again when the cache serves it, so a warm-cache trace reports what a
  cold one does.
- ``dtcompile_spmd_types/``: its outputs' SPMD types (:mod:`dtcompile.spmd.carry`),
  stamped on its outputs when the cache serves it, so the next graph starts typed
  on a warm run as on a cold one.

Writes are atomic (a temporary file, then a rename); a file that cannot be
written is a warning, one that cannot be read is ``None``: the caller then does
without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

__all__ = ["load_beside_cache", "save_beside_cache"]

log = logging.getLogger(__name__)


def _path(folder: str, key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir()) / folder / f"{digest}.json"


def save_beside_cache(folder: str, key: str, data: Any) -> None:
    """Writes ``data`` (JSON) for the graph keyed ``key`` into ``folder`` beside the compile cache."""
    path = _path(folder, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as exc:  # a read-only cache: the callers do without it
        log.warning("dtcompile: could not save %s: %s", path, exc)


def load_beside_cache(folder: str, key: str) -> Any | None:
    """What :func:`save_beside_cache` wrote for ``key`` in ``folder``, or ``None``."""
    try:
        return json.loads(_path(folder, key).read_text())
    except (OSError, ValueError):
        return None
