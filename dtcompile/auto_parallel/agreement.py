"""Ranks given different plans of one model stop with an error, before either applies its plan.

A plan is made once per rank (every rank calls :func:`~dtcompile.auto_parallel.plan`),
or once for all of them on the fake process group, and applied on every rank by
:func:`~dtcompile.auto_parallel.parallelize` (:func:`~dtcompile.auto_parallel.auto_parallel`
does both).  The same program under the same settings gets the same plan (the
measurements are DTensor's answers, HiGHS is deterministic), but what a plan is made
from need not be the same on every rank: example inputs whose shapes are the rank's
own (a batch padded to its longest sequence), a calibrated cost profile on one host
only, a budget or a pin computed per rank.  Ranks that apply different plans run
models whose collectives do not pair up: gloo aborts, NCCL hangs until its watchdog
fires, or, where the sizes happen to agree, the numbers are wrong.  So before
``parallelize`` distributes a parameter, the ranks of its mesh compare the plans they
apply (:func:`dtcompile.ranks.check.meet`: one exchange through the process group's
store, no collective) and then all do the same:

- all apply the same placements for every node: each goes on;
- some apply others: every rank raises :class:`~dtcompile.ranks.check.RanksDisagree`,
  naming the ranks on each side, the first node whose placements differ and what the
  plans were made from that differs between them (the example inputs' shapes, the cost
  profile, a budget, a pin, the versions);
- a rank could not plan on the mesh (an error of its own): it raises that error, and
  its peers, once they apply theirs, a :class:`~dtcompile.ranks.check.RanksDisagree`
  quoting it, at once rather than after a timeout;
- a peer does not come within the compile config's ``check_ranks_timeout_s``: a
  :class:`~dtcompile.ranks.check.RanksDisagree` naming it.

Planning itself waits for no peer: a plan made on one rank alone (to print it, to
compare budgets) returns as soon as it is made.  The comparison is governed by the
config the plan was made with (``config=``): off with ``check_ranks=False``; skipped
where ranks cannot differ: no process group, the fake one, a mesh of one rank.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from dtcompile.auto_parallel.placements import text

__all__ = ["MadeFrom", "PlanMeeting", "compare_applied", "peers_learn_failure", "plan_lines"]


@dataclass(frozen=True)
class MadeFrom:
    """What a plan was made from, besides the model's code, and how the ranks that apply it
    compare it (the plan's compile config's ``check_ranks`` and ``check_ranks_timeout_s``, under
    their names: a :class:`PlanMeeting` reads either)."""

    check_ranks: bool
    check_ranks_timeout_s: float
    example_inputs: str
    """The example inputs' dtypes and shapes (``float32[4096, 16], int64[8]``): the tensors
    are not kept."""
    profile: Any
    settings: Mapping[str, str] = field(default_factory=dict)
    """The budgets, pins, optimizer states and compile options, each as text."""

    @classmethod
    def of(cls, config: Any, example_inputs: Any, profile: Any, settings: Mapping[str, Any]) -> MadeFrom:
        def one(value: Any) -> str:
            if isinstance(value, torch.Tensor):
                return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
            return repr(value)[:80]

        inputs = ", ".join(one(v) for v in pytree.tree_leaves(example_inputs))
        return cls(config.check_ranks, config.check_ranks_timeout_s, inputs, profile,
                   {name: repr(value) for name, value in settings.items()})

    def facts(self) -> dict[str, str]:
        """As the ranks compare them: also the cost profile's numbers, dtcompile's source and
        torch's version (asked only where ranks compare)."""
        from dtcompile.cache_keys import profile_text, source_digest

        return {
            "example inputs": self.example_inputs,
            "cost profile": f"{self.profile.name}, numbers {profile_text(self.profile)}",
            **self.settings,
            "dtcompile source": source_digest(),
            "torch": torch.__version__,
        }


def plan_lines(solution: Any) -> list[str]:
    """Each node's chosen placements, one line per node in the program's order
    (``mm_3: (S(0)R, RS(1)) -> S(0)S(1)``; a placeholder's ``w1.weight: -> S(0)``): what
    ranks compare."""
    lines = []
    for name in solution.problem.nodes:
        c = solution.choice(name)
        outs = ", ".join(text(o) for o in c.outputs if o is not None)
        local = f" on local shards ({c.local})" if c.local else ""
        ins = f"({', '.join(text(i) for i in c.inputs)}) " if c.inputs else ""
        lines.append(f"{solution.display_name(name)}: {ins}-> {outs}{local}")
    return lines


class PlanMeeting:
    """The mesh's ranks comparing the plan they apply (see the module); ``ranks`` empty: no comparison."""

    def __init__(self, ranks: Sequence[int], timeout_s: float) -> None:
        self.ranks = list(ranks)
        self.timeout_s = timeout_s

    @classmethod
    def of(cls, mesh: Any, checks: Any) -> PlanMeeting:
        """``checks``: a compile config, or a plan's :class:`MadeFrom` (its ``check_ranks`` and
        ``check_ranks_timeout_s``)."""
        from torch.distributed.device_mesh import DeviceMesh

        from dtcompile.ranks.check import is_simulated, world_can_disagree

        if not (checks.check_ranks and isinstance(mesh, DeviceMesh) and world_can_disagree()):
            return cls((), 0.0)
        import torch.distributed as dist

        ranks = mesh.mesh.flatten().tolist()
        simulated = any(is_simulated(mesh.get_group(axis)) for axis in range(mesh.ndim))
        if len(ranks) < 2 or simulated or dist.get_rank() not in ranks:
            return cls((), 0.0)
        return cls(ranks, checks.check_ranks_timeout_s)

    def _meet(self, entry: Mapping[str, Any], detail: str, wait: bool = True) -> list[dict[str, Any]]:
        import torch.distributed as dist

        from dtcompile.ranks.check import meet

        rank = dist.get_rank()
        return meet(
            "auto_parallel", self.ranks, entry, detail, self.timeout_s, wait=wait,
            waiting=f"rank {rank} waits for the mesh's ranks {self.ranks} to compare the plans they apply",
            ended=f"auto_parallel: the plans' comparison on ranks {self.ranks} was ended",
            late=lambda missing: (
                f"auto_parallel: rank(s) {missing} of the mesh's ranks {self.ranks} did not come to apply their plan "
                f"within check_ranks_timeout_s={self.timeout_s:g} s of rank {rank}: they are still planning (one "
                "rank's measurements kept from an earlier run, another's not: raise check_ranks_timeout_s in the "
                "config the plan was made with, config=), apply another model, or have stopped; every rank of the "
                "mesh applies the plan, with dtcompile.auto_parallel.parallelize(model, solution, mesh) (auto_parallel "
                "does it)"
            ),
        )

    def failed(self, error: BaseException) -> None:
        """This rank could not plan: its peers learn it at the comparison (it does not wait)."""
        if self.ranks:
            self._meet({"failed": f"{type(error).__name__}: {error}"[:2000]}, "", wait=False)

    def compare(self, solution: Any) -> None:
        """Returns where every rank applies what this one does; else raises on every rank (with
        what each plan was made from: its ``made_from``, :class:`MadeFrom`)."""
        if not self.ranks:
            return
        import torch.distributed as dist

        from dtcompile.ranks.check import RanksDisagree, read_detail
        from dtcompile.ranks.schedule import short_digest

        start = time.perf_counter()
        lines = plan_lines(solution)
        made_from = solution.made_from
        peers = self._meet({"plan": short_digest("\n".join(lines)), "facts": made_from.facts() if made_from else {}}, "")
        solution.problem.seconds["ranks"] = time.perf_counter() - start
        failed = [p for p in peers if "failed" in p]
        if failed:
            raise RanksDisagree(
                f"auto_parallel: rank(s) {[p['rank'] for p in failed]} of the mesh's ranks {self.ranks} could not "
                f"plan the model (rank {failed[0]['rank']}: {failed[0]['failed']}); every rank stops here, as ranks "
                "with a plan and ranks without one would run different programs"
            )
        sides: dict[str, list[int]] = {}
        for peer in peers:
            sides.setdefault(peer["plan"], []).append(peer["rank"])
        if len(sides) == 1:
            return
        # Every rank knows now: the first rank of the first two sides (in rank order) hand
        # over their plans' lines, which the message compares.
        a, b = (min(ranks) for ranks in list(sides.values())[:2])
        shown = self._meet({}, json.dumps(lines) if dist.get_rank() in (a, b) else "")
        by_rank = {p["rank"]: p for p in peers}
        plans = {p["rank"]: json.loads(read_detail(p)) for p in shown if p["rank"] in (a, b)}
        raise RanksDisagree(_disagreement([sorted(r) for r in sides.values()], by_rank[a], plans[a], by_rank[b], plans[b]))


def compare_applied(solution: Any, mesh: Any) -> None:
    """The mesh's ranks compare the plan each applies (see the module), as the config the plan
    was made with says; raises :class:`~dtcompile.ranks.check.RanksDisagree` on every rank where
    they differ."""
    from dtcompile.config import DTCompileConfig

    # (A solution not made by plan() is compared as the default config says.)
    PlanMeeting.of(mesh, solution.made_from or DTCompileConfig()).compare(solution)


def _disagreement(sides: list[list[int]], a: Mapping[str, Any], plan_a: list[str], b: Mapping[str, Any],
                  plan_b: list[str]) -> str:
    ra, rb = a["rank"], b["rank"]
    lines = [
        "auto_parallel: ranks apply different plans of the model: the models they would run issue collectives that "
        "do not pair up (gloo aborts, NCCL hangs, or the numbers are wrong), so every rank stops here.",
        "  the plans: " + ", ".join(f"ranks {ranks} {'one' if i == 0 else 'another'}" for i, ranks in enumerate(sides)),
    ]
    first = next(((x, y) for x, y in zip(plan_a, plan_b) if x != y), None)
    if first is not None:
        lines.append(f"  first difference: {first[0]} on rank {ra}; {first[1]} on rank {rb}")
    else:
        longer, rank = (plan_a, ra) if len(plan_a) > len(plan_b) else (plan_b, rb)
        lines.append(f"  first difference: {longer[min(len(plan_a), len(plan_b))]} on rank {rank} only")
    from dtcompile.ranks.disagreement import differences

    differs = differences(a["facts"], b["facts"], ra, rb)
    if differs:
        lines.append("  what differs: " + "; ".join(differs))
    else:
        lines.append("  nothing the plans were made from differs but the model's code: it traced to another program "
                     "on each (code that reads the rank), or a bug in dtcompile (please report it)")
    lines.append(
        "  Fix: give every rank the same example inputs (the global shapes, not each rank's own batch: meta "
        "tensors will do), budgets, pins and cost profile; a plan made with config=dtcompile.backend(check_ranks=False) skips this check."
    )
    return "\n".join(lines)


@contextlib.contextmanager
def peers_learn_failure(mesh: Any, config: Any) -> Iterator[None]:
    """An error raised inside (this rank could not plan on ``mesh``) is left for the mesh's other
    ranks to read where they compare the plans they apply, before it is raised."""
    from dtcompile.ranks.check import RanksDisagree

    try:
        yield
    except RanksDisagree:
        raise
    except Exception as exc:
        PlanMeeting.of(mesh, config).failed(exc)
        raise
