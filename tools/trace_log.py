"""Reading a ``TORCH_TRACE`` directory for ``dtcompile-report``: :func:`read_trace` and what it returns.

One log per rank (``dedicated_log_torch_trace_rank_<r>_*.log``); of each, what dtcompile
logged (the ``dtcompile_*`` artifacts of :mod:`dtcompile.artifacts`, by
:func:`dtcompile.base.channels.parse_artifact`) and what Dynamo logged about graph breaks
and recompiles, per rank and compile id (:class:`Trace`).  :mod:`dtcompile_tools.report`
renders it.

The log format: a line ``<glog prefix>] {json metadata}`` starts an entry; the
payload follows on lines that begin with a tab, and the metadata's
``has_payload`` is the payload's md5.  A log whose program was killed ends
mid-entry: that last entry is left out, with a warning naming file:line, and
the rest is read.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtcompile.base.channels import parse_artifact
from dtcompile.base.progress import track

__all__ = ["CompileRecord", "RankTrace", "Trace", "TraceError", "read_trace"]

_RANK_FILE = re.compile(r"dedicated_log_torch_trace_rank_(\d+)_.*\.log$")
_ENTRY = re.compile(r"^[A-Z]\d{4} [\d:.]+ +\d+ [^\]]*\] (\{.*\})$")


class TraceError(ValueError):
    """The trace directory is missing, empty or not a TORCH_TRACE log."""


@dataclass
class CompileRecord:
    """What one rank logged for one compile id, per graph kind where per graph."""

    placements: str = ""
    graphs: dict[str, str] = field(default_factory=dict)
    collectives: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each graph's compile seconds per stage (:func:`dtcompile.artifacts.compile_seconds_json`):
    the last logged, which a later stage (the ranks' check) may have added to."""


@dataclass
class RankTrace:
    rank: int
    compiles: dict[str, CompileRecord] = field(default_factory=lambda: defaultdict(CompileRecord))
    graph_breaks: list[str] = field(default_factory=list)
    recompiles: list[str] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)
    """``dtcompile.auto_parallel`` solutions, each its ``explain()`` (logged as it planned)."""
    fallbacks: list[str] = field(default_factory=list)
    """Graphs run eagerly because torch could not trace them (why, and the Dynamo graph)."""
    cached: list[str] = field(default_factory=list)
    """Graphs AOTAutograd's cache served: compiled by an earlier run, so not shown here."""


@dataclass
class Trace:
    ranks: dict[int, RankTrace]
    warnings: list[str] = field(default_factory=list)
    """What was left out and why (a log cut off mid-entry), each naming file:line."""


def _compile_id(meta: dict[str, Any]) -> str:
    if meta.get("frame_id") is None:
        return "-"
    cid = f"{meta['frame_id']}/{meta.get('frame_compile_id', 0)}"
    return cid + (f"_{meta['attempt']}" if meta.get("attempt") else "")


def _entry_name(meta: dict[str, Any]) -> str:
    artifact = meta.get("artifact")
    return f"artifact {artifact.get('name', '?')}" if isinstance(artifact, dict) else f"entry {next(iter(meta), '?')}"


def _entries(path: Path, warnings: list[str]) -> list[tuple[int, dict[str, Any], str]]:
    """The entries of one log, each as (line number, metadata, payload).

    Only the end of a log can be incomplete (its program was killed while
    writing): a last line without its newline, or a last entry whose payload
    does not match the md5 in its ``has_payload``.  That entry is left out and
    a warning added to ``warnings``; anything else malformed is a TraceError.
    """
    # Split on "\n" only, from bytes: torch writes a payload one "\n"-separated line
    # at a time and hashes it, so no other line break may split or change it.
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    # A complete log ends with a newline, so with "" here; else its last line is cut off.
    partial_last_line = lines[-1] != ""
    if not partial_last_line:
        lines.pop()
    entries: list[tuple[int, dict[str, Any], list[str]]] = []
    for number, line in enumerate(lines, start=1):
        if line.startswith("\t"):
            if not entries:
                raise TraceError(f"{path}:{number}: a payload line before any log entry; is this a TORCH_TRACE log?")
            entries[-1][2].append(line[1:])
            continue
        match = _ENTRY.match(line)
        problem = None if match else f"not a TORCH_TRACE log line: {line[:80]!r}"
        if match:
            try:
                entries.append((number, json.loads(match.group(1)), []))
            except json.JSONDecodeError as err:
                problem = f"malformed JSON metadata ({err.msg})"
        if problem is None:
            continue
        if partial_last_line and number == len(lines):
            warnings.append(f"{path}:{number}: the log ends in the middle of this line (was the program killed?); left it out")
            break
        raise TraceError(f"{path}:{number}: {problem}")
    if entries:
        number, meta, payload = entries[-1]
        digest = hashlib.md5("\n".join(payload).encode(), usedforsecurity=False).hexdigest()
        if "has_payload" in meta and digest != meta["has_payload"]:
            warnings.append(
                f"{path}:{number}: the log ends inside this entry's payload ({_entry_name(meta)}; "
                "was the program killed?); left the entry out"
            )
            entries.pop()
    return [(number, meta, "\n".join(payload)) for number, meta, payload in entries]


def _json_payload(file: Path, number: int, name: str, payload: str) -> Any:
    try:
        return json.loads(payload)
    except json.JSONDecodeError as err:
        raise TraceError(f"{file}:{number}: the payload of artifact {name} is not valid JSON ({err.msg})") from None


def read_trace(trace_dir: str | Path) -> Trace:
    """Parse every rank's log in ``trace_dir``; raises :class:`TraceError` with the reason."""
    path = Path(trace_dir)
    if not path.is_dir():
        raise TraceError(f"{path}: no such directory; pass the directory TORCH_TRACE pointed at")
    files = sorted(p for p in path.iterdir() if _RANK_FILE.search(p.name))
    if not files:
        raise TraceError(
            f"{path}: no TORCH_TRACE logs (dedicated_log_torch_trace_rank_*.log); "
            "run the program with TORCH_TRACE set to this directory"
        )
    ranks: dict[int, RankTrace] = {}
    warnings: list[str] = []
    for file in track(files, "dtcompile-report: reading logs", unit="log"):
        file_rank = int(_RANK_FILE.search(file.name).group(1))
        entries = _entries(file, warnings)
        logged = sorted({meta["artifact"]["rank"] for _, meta, _ in entries if _threaded(meta)})
        threads = len(logged) > 1
        if threads:
            warnings.append(
                f"{file.name}: ranks {logged} ran as threads of one process and share this log: dtcompile's "
                "entries are read per rank (each rank's compiles numbered in its own order), Dynamo's "
                "graph-break and recompile entries cannot be attributed to a rank and are left out (a "
                "thread's first compile reads as a recompile of another's there)"
            )
            simulated = [e for e in entries if _in_world(e[1]) and not _threaded(e[1])]
            if simulated:
                warnings.append(
                    f"{file.name}: {len(simulated)} entries of a compile in a one-process simulated world "
                    "(fake_world, explain()) beside the threads: left out of the per-rank view"
                )
                entries = [e for e in entries if not (_in_world(e[1]) and not _threaded(e[1]))]
        renumber = _per_rank_compile_ids(entries) if threads else {}
        # Artifacts logged outside a torch compile (a whole-step graph's: graph_trainer's
        # pipeline, compile_step) carry no compile id of torch's: each is keyed by the id its
        # collectives artifact names (step/0), the graph logged before it gathered meanwhile.
        unkeyed: dict[int, CompileRecord] = defaultdict(CompileRecord)
        for number, meta, payload in entries:
            artifact = meta.get("artifact")
            if not artifact or (threads and "rank" not in artifact):  # threads: Dynamo's own, not attributable
                continue
            # A log of its own rank (gloo, torchrun, one process) is that rank's, as torch named it.
            rank = artifact["rank"] if threads else file_rank
            name, cid = artifact.get("name", ""), _compile_id(meta)
            cid = renumber.get((rank, cid), cid)
            trace = ranks.setdefault(rank, RankTrace(rank))
            what, kind = parse_artifact(name) or (name, None)
            if cid == "-" and what in ("placements", "graph"):
                if what == "graph":
                    unkeyed[rank].graphs[str(kind)] = payload
                else:
                    unkeyed[rank].placements = payload
                continue
            if cid == "-" and what == "collectives":
                data = _json_payload(file, number, name, payload)
                key = _unused(trace.compiles, str(data.get("compile_id") or cid))
                trace.compiles[key] = unkeyed.pop(rank, CompileRecord())
                trace.compiles[key].collectives[data["kind"]] = data
                continue
            if what == "compile_seconds":
                data = _json_payload(file, number, name, payload)
                # Logged again at the first call (the ranks' check), outside torch's compile: by
                # the compile whose graphs dtcompile logged under the id it names.
                key = cid if cid != "-" else _logged_as(trace.compiles, str(data.get("compile_id")))
                trace.compiles[key].seconds[data["kind"]] = data
            elif what == "auto_parallel_solution":
                trace.plans.append(payload)
            elif what == "eager_fallback":
                trace.fallbacks.append(payload)
            elif what == "cached_compile":
                trace.cached.append(payload)
            elif what == "placements":
                trace.compiles[cid].placements = payload
            elif what == "graph":
                trace.compiles[cid].graphs[str(kind)] = payload
            elif what == "collectives":
                data = _json_payload(file, number, name, payload)
                trace.compiles[cid].collectives[data["kind"]] = data
            elif name == "dynamo_graph_break_reason":
                # "Graph break in user code at file:line", the reason, Dynamo's explanation.
                trace.graph_breaks.append(f"{cid}: " + "\n".join(payload.splitlines()[:6]).strip())
            elif name == "recompile_reasons":
                # Labelled json, written as text: one "<compile id>: reason" per line.
                reasons = _json_payload(file, number, name, payload) if payload.startswith("[") else payload.splitlines()
                trace.recompiles += [f"{cid}: recompiled because {r}" for r in reasons if r.strip()]
    return Trace(ranks, warnings)


def _in_world(meta: dict[str, Any]) -> bool:
    artifact = meta.get("artifact")
    return isinstance(artifact, dict) and "rank" in artifact


def _threaded(meta: dict[str, Any]) -> bool:
    """An artifact dtcompile logged on a rank run as a thread (the threaded process group)."""
    return _in_world(meta) and meta["artifact"].get("world") == "threaded"


def _per_rank_compile_ids(entries: list[tuple[int, dict[str, Any], str]]) -> dict[tuple[int, str], str]:
    """For a log that ranks run as threads share: ``(rank, compile id) -> the id renumbered in
    that rank's own order`` (a frame's compiles 0/0, 0/1, 0/2 by threads 0, 1, 2 are each
    thread's first, 0/0), from the ranks dtcompile's artifacts name."""
    seen: dict[tuple[int, str], list[str]] = defaultdict(list)
    for _, meta, _ in entries:
        cid = _compile_id(meta)
        if not _in_world(meta) or cid == "-":
            continue
        ids = seen[(meta["artifact"]["rank"], cid.partition("/")[0])]
        if cid not in ids:
            ids.append(cid)
    return {(rank, cid): f"{frame}/{i}" for (rank, frame), ids in seen.items() for i, cid in enumerate(ids)}


def _logged_as(compiles: dict[str, CompileRecord], compile_id: str) -> str:
    """The key of the last compile read whose graphs dtcompile logged as ``compile_id``
    (the id in their collectives artifact: ``0/0``, ``step/0``), else ``compile_id``."""
    keys = [key for key, record in compiles.items() if any(d.get("compile_id") == compile_id for d in record.collectives.values())]
    return keys[-1] if keys else compile_id


def _unused(compiles: dict[str, CompileRecord], key: str) -> str:
    """``key``, or ``key (2)``, ``key (3)``... where a record of that key was read already
    (two whole-step graphs made by different passes of one process)."""
    if key not in compiles:
        return key
    n = 2
    while f"{key} ({n})" in compiles:
        n += 1
    return f"{key} ({n})"
