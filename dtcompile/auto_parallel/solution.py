"""What the solver chose, node by node: layouts, costs, the collectives it implies, and why.

``solution.explain()`` prints one line per node of the problem in graph order::

    mm = aten.mm(view, t)  # placement=(S(0), R) -> S(0), cost=[0.01, 0.00, 8.41]

``placement=(inputs) -> outputs`` in the short notation of :mod:`dtcompile.hops.spec`
(``S(0)R``: ``Shard(0)`` on the first mesh axis, ``Replicate()`` on the second),
and ``cost=[own, arg 0, arg 1, ...]`` in microseconds: the node's own forward and
backward (roofline compute plus the collectives DTensor issues inside its
backward), then per tensor argument the redistributions that bring it to the
node and its gradient back (an edge out of a parameter without its collectives'
launch latency, which its bucket's ``# bucket`` line counts once).  A value several nodes read is redistributed once,
by its fan-out line (``x_fanout = redistribute(x)``), whose readers then cost
nothing for it.  A node DTensor has no strategy for says so (``runs on local shards
(borrowed)`` or ``(replicated)``, :mod:`dtcompile.auto_parallel.local_ops`), and a
closing line names each.  ``solution.explain(name)`` lists every candidate of one node with
what it would cost if that node alone changed, and why it lost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dtcompile.auto_parallel.agreement import MadeFrom
from dtcompile.auto_parallel.graph import Candidate, Problem
from dtcompile.auto_parallel.peak import PeakEstimate, StepMemory, step_memory
from dtcompile.auto_parallel.placements import Layout, PlannedCollective, text
from dtcompile.auto_parallel.solver import SolveResult
from dtcompile.auto_parallel.transfer import Transfer, bucketed_time_us, launch_latency_us, transfer
from dtcompile.base.notation import format_bytes

__all__ = ["Solution"]


class Solution:
    """The chosen strategy of every node of a :class:`~dtcompile.auto_parallel.problem.Problem`."""

    def __init__(self, problem: Problem, result: SolveResult, param_memory_budget_bytes: int | None = None,
                 memory: StepMemory | None = None, memory_budget_bytes: int | None = None,
                 optimizer_states: int = 0, made_from: MadeFrom | None = None) -> None:
        self.problem = problem
        # What the plan was made from, and how the ranks applying it compare it (agreement).
        self.made_from = made_from
        self.result = result
        self.param_memory_budget_bytes = param_memory_budget_bytes
        self._memory = memory
        self._states = optimizer_states
        self.memory_budget_bytes = memory_budget_bytes
        self._cache: dict[Any, Transfer | None] = {}
        self._edges = {(e.consumer, e.slot): e for e in problem.edges}
        self._fanout_of = {(link.consumer, link.slot): link.fanout for link in problem.fanout_rules}
        self._readers: dict[str, list[tuple[str, int]]] = {}
        for e in problem.edges:
            self._readers.setdefault(e.producer, []).append((e.consumer, e.slot))
        t = problem.traced
        self._display = {node.name: name for name, node in t.params + t.buffers}
        self._display.update({node.name: f"input{i}" for i, node in enumerate(t.inputs)})

    # The choices, as plain data.

    def choice(self, name: str) -> Candidate:
        """The chosen candidate of problem node ``name``."""
        return self.problem.nodes[name].candidates[self.result.choice[name]]

    @property
    def stats(self) -> dict[str, float]:
        """How the plan was made: seconds per stage (``trace_s``, ``strategies_s``, ``measure_s``,
        ``edges_s``, ``memory_s`` (the step's peak model, under a step budget), ``solve_s``, ``ranks_s``
        (once applied on real ranks: comparing the plan with the mesh's other ranks', waiting for them
        included: :mod:`~dtcompile.auto_parallel.agreement`), and ``apply_s`` once
        :func:`~dtcompile.auto_parallel.auto_parallel` applied it), measurements ``made`` and ``reused`` (from earlier nodes and plans), the
        ``candidates`` of the program before and after dominated ones were removed
        (``candidates_kept``), its ``variables`` and ``constraints``."""
        stats: dict[str, float] = {f"{stage}_s": s for stage, s in self.problem.seconds.items()}
        stats.update({f"measurements_{k}": n for k, n in self.problem.measurements.items()})
        r = self.result
        stats.update(candidates=r.num_candidates, candidates_kept=r.num_kept, variables=r.num_variables,
                     constraints=r.num_constraints)
        return stats

    @property
    def cost_us(self) -> float:
        """The step's estimated time (the objective): every node's own cost and every edge's."""
        return self.result.objective_us

    @property
    def param_placements(self) -> dict[str, Layout]:
        """Parameter name -> its chosen placements."""
        return {name: self.choice(node.name).outputs[0] for name, node in self.problem.traced.params}

    @property
    def input_placements(self) -> list[Layout]:
        """Per flattened input, the placements the parallel model lays it out in."""
        return [self.choice(node.name).outputs[0] for node in self.problem.traced.inputs]

    @property
    def output_placements(self) -> list[Layout]:
        """Per flattened output, the placements the parallel model returns it in."""
        outputs = [n for n in self.problem.nodes.values() if n.kind == "output"]
        return [self.choice(n.name).inputs[0] for n in outputs]

    def param_bytes_per_rank(self) -> int:
        return sum(sizes[self.result.choice[name]] for name, sizes in self.problem.param_bytes.items())

    @property
    def memory(self) -> StepMemory:
        """The step's peak memory model (:mod:`~dtcompile.auto_parallel.peak`): the one the plan
        kept to its budget, else built when first asked for."""
        if self._memory is None:
            self._memory = step_memory(self.problem, self._states)
        return self._memory

    def peak_memory(self) -> PeakEstimate:
        """The training step's estimated peak per rank under this plan, in all and by kind
        (:mod:`~dtcompile.auto_parallel.peak`)."""
        return self.memory.estimate(self.problem, self.result.choice)

    @property
    def local_nodes(self) -> dict[str, str]:
        """Node name -> how its op runs outside DTensor's dispatch, for every node DTensor has no
        strategy for (``borrowed``: a twin op's strategies; ``replicated``: the fallback), see
        :mod:`dtcompile.auto_parallel.local_ops`."""
        return {name: self.choice(name).local for name in self.problem.nodes if self.choice(name).local}

    @property
    def decomposed(self) -> dict[str, list[str]]:
        """Op (``aten.glu``) -> the nodes of its decomposition, for every op DTensor has no strategy
        for that was traced as its registered decomposition (:mod:`~dtcompile.auto_parallel.local_ops`)."""
        found: dict[str, list[str]] = {}
        for name, op in self.problem.traced.decomposed.items():
            if name in self.problem.nodes:
                found.setdefault(op, []).append(name)
        return found

    def fanout_of(self, name: str, slot: int) -> str | None:
        """The fan-out node argument ``slot`` of ``name`` reads through, if its value has several readers."""
        return self._fanout_of.get((name, slot))

    def _transfer(self, edge: Any, producer_choice: int, consumer_choice: int) -> Transfer | None:
        p, c = self.problem.nodes[edge.producer], self.problem.nodes[edge.consumer]
        pc, cc = p.candidates[producer_choice], c.candidates[consumer_choice]
        shape, dtype = p.outputs[edge.index]
        grad = cc.grads[edge.slot] if p.requires_grad[edge.index] and cc.grads else None
        want = pc.grad_out[edge.index] if pc.grad_out else None
        return transfer(shape, dtype, pc.outputs[edge.index], want, cc.inputs[edge.slot], grad,
                        self.problem.mesh, self.problem.profile, self._cache,
                        edge.regather)

    def _edge_us(self, edge: Any, producer_choice: int, consumer_choice: int) -> float | None:
        """An edge's time as the solver costed it (a parameter edge's collectives bucketed)."""
        t = self._transfer(edge, producer_choice, consumer_choice)
        if t is None:
            return None
        if edge.buckets is not None:
            return bucketed_time_us(t, self.problem.profile, self.problem.bucket_cap_bytes)[0]
        return t.time_us

    def edge_us(self, consumer: str, slot: int) -> float:
        """The chosen edge into ``consumer``'s argument ``slot``, as costed (0 when it reads a fan-out)."""
        edge = self._edges.get((consumer, slot))
        if edge is None:
            return 0.0
        return self._edge_us(edge, self.result.choice[edge.producer], self.result.choice[consumer])

    def edge_transfer(self, consumer: str, slot: int) -> Transfer | None:
        """The chosen redistributions into ``consumer``'s argument ``slot`` (``None``: it reads a fan-out)."""
        edge = self._edges.get((consumer, slot))
        if edge is None:
            return None
        return self._transfer(edge, self.result.choice[edge.producer], self.result.choice[consumer])

    def predicted_collectives(self) -> list[PlannedCollective]:
        """Every collective the chosen plan implies, forward and backward: inside ops, and
        in the redistributions between them, in graph order."""
        found: list[PlannedCollective] = []
        for node in self.problem.nodes.values():
            found += self.choice(node.name).collectives
            for slot in range(len(node.inputs)):
                t = self.edge_transfer(node.name, slot)
                if t is not None:
                    found += t.collectives
        return found

    # Explanations.

    def display_name(self, node_name: str) -> str:
        """A placeholder's parameter name (``w1.weight``) or ``input0``; a fan-out's
        ``<value>_fanout``; other nodes' own names."""
        node = self.problem.nodes.get(node_name)
        if node is not None and node.kind == "fanout":
            producer, index = node.inputs[0]
            return f"{self.display_name(producer)}_fanout" + (str(index) if index else "")
        return self._display.get(node_name, node_name)

    _name = display_name

    def _line(self, name: str) -> str:
        node = self.problem.nodes[name]
        c = self.choice(name)
        costs = [c.cost_us] + [self.edge_us(name, s) for s in range(len(node.inputs))]
        cost = ", ".join(f"{x:.2f}" for x in costs)
        outs = [text(o) for o in c.outputs if o is not None]
        placement = f"({', '.join(text(i) for i in c.inputs)}) -> {', '.join(outs)}"
        if node.kind in ("param", "buffer", "input"):
            shape, dtype = node.outputs[0]
            call = f"{node.kind}({str(dtype).removeprefix('torch.')}{list(shape)})"
        elif node.fx_node is not None and node.kind != "region":
            call = f"{node.target}({self._args_text(node.fx_node)})"
        else:
            args = ", ".join(self._name(p) if k == 0 else f"{self._name(p)}[{k}]" for p, k in node.inputs)
            call = f"{'redistribute' if node.kind == 'fanout' else node.target}({args})"
        local = f", runs on local shards ({c.local})" if c.local else ""
        return f"{self._name(name)} = {call}  # placement={placement}, cost=[{cost}]{local}"

    def _args_text(self, fx_node: Any) -> str:
        """The node's arguments as in the traced graph: values by name, constants as written."""
        import operator

        def one(a: Any) -> str:
            if hasattr(a, "op"):  # an fx.Node
                if a.op == "call_function" and a.target is operator.getitem:
                    return f"{self._name(a.args[0].name)}[{a.args[1]}]"
                return self._name(a.name)
            if isinstance(a, (list, tuple)):
                inner = ", ".join(one(x) for x in a)
                return f"[{inner}]" if isinstance(a, list) else f"({inner})"
            return repr(a)

        parts = [one(a) for a in fx_node.args] + [f"{k}={one(v)}" for k, v in fx_node.kwargs.items()]
        return ", ".join(parts)

    def explain(self, name: str | None = None, *, against: Mapping[str, Any] | None = None) -> str:
        """Every node's line (see the module docstring); with ``name`` (a node, parameter or
        ``input0``...), that node's candidates and why each lost; with ``against`` (another
        plan's placements by parameter name, e.g. a hand-written tensor-parallel plan's), a line
        for each parameter placed differently: both placements, and why the other one lost."""
        if against is not None:
            return self._explain_against(against)
        if name is None:
            fanouts: dict[str, list[str]] = {}
            for n in self.problem.nodes.values():
                if n.kind == "fanout":
                    fanouts.setdefault(n.inputs[0][0], []).append(n.name)
            lines = []
            for n in self.problem.nodes.values():  # a fan-out's line follows its value's
                if n.kind != "fanout":
                    lines += [self._line(n.name)] + [self._line(f) for f in fanouts.get(n.name, [])]
            for bucket in self.result.buckets:
                direction, op, axis, size, _ = bucket
                lines.append(
                    f"# bucket: {direction} {op}[{axis}] x{size} of parameter collectives, "
                    f"launch {launch_latency_us(bucket, self.problem.profile):.2f} us"
                )
            for node_name, how in self.local_nodes.items():
                lines.append(
                    f"# {node_name} ({self.problem.nodes[node_name].target}) has no DTensor strategy: "
                    + ("planned with its twin's, run on local shards" if how == "borrowed"
                       else "its inputs replicated, run whole on every rank")
                )
            for op, names in self.decomposed.items():
                lines.append(f"# {op} has no DTensor strategy: planned as its decomposition ({', '.join(names)})")
            lines.append(
                f"# estimated step: {self.cost_us:.2f} us ({self.problem.profile.name}); "
                f"parameters {self.param_bytes_per_rank()} B per rank"
            )
            budget = "" if self.memory_budget_bytes is None else f", budget {format_bytes(self.memory_budget_bytes)}"
            lines.append(f"# estimated peak: {self.peak_memory()}{budget}")
            return "\n".join(lines)
        return self._explain_node(self._resolve(name))

    def _resolve(self, name: str) -> str:
        if name in self.problem.nodes:
            return name
        for node_name, display in self._display.items():
            if display == name:
                return node_name
        raise KeyError(f"Solution.explain: no node or parameter named {name!r}; the nodes are {list(self.problem.nodes)}")

    def _local_cost(self, name: str, index: int) -> tuple[float, str]:
        """What the step would cost around node ``name`` with candidate ``index``, its
        neighbours' choices kept; ``inf`` and the reason when it cannot be."""
        node = self.problem.nodes[name]
        cand = node.candidates[index]
        total = cand.cost_us * len(self.problem.groups()[node.group])
        for slot in range(len(node.inputs)):
            edge = self._edges.get((name, slot))
            if edge is not None:
                t = self._edge_us(edge, self.result.choice[edge.producer], index)
                if t is None:
                    return math.inf, f"argument {slot} cannot come from {self._name(edge.producer)} in {text(cand.inputs[slot])}"
                total += t
            else:
                fan = self._fanout_of[(name, slot)]
                fc = self.choice(fan)
                if cand.inputs[slot] != fc.inputs[0] or (fc.grads[0] is not None and cand.grads[slot] not in (None, fc.grads[0])):
                    return math.inf, f"the other readers of {self._name(node.inputs[slot][0])} read it as {text(fc.inputs[0])}"
        for consumer, slot in self._readers.get(name, []):
            edge = self._edges[(consumer, slot)]
            t = self._edge_us(edge, index, self.result.choice[consumer])
            if t is None:
                return math.inf, f"{self._name(consumer)} cannot read it in its chosen layout"
            total += t
        if name in self.problem.param_bytes and self.param_memory_budget_bytes is not None:
            sizes = self.problem.param_bytes[name]
            over = self.param_bytes_per_rank() - sizes[self.result.choice[name]] + sizes[index]
            if over > self.param_memory_budget_bytes:
                return math.inf, f"parameters would take {over} B per rank, over the budget of {self.param_memory_budget_bytes} B"
        return total, ""

    def _verdict(self, name: str, index: int) -> str:
        """Candidate ``index`` of node ``name`` against the chosen one, the neighbours' choices kept."""
        chosen = self.result.choice[name]
        cost, why = self._local_cost(name, index)
        if index == chosen:
            return f"{cost:.3f} us  chosen"
        if math.isinf(cost):
            return f"impossible: {why}"
        base, _ = self._local_cost(name, chosen)
        if cost >= base:
            return f"{cost:.3f} us  lost by {cost - base:.3f} us"
        return f"{cost:.3f} us  cheaper alone, but the neighbours' best choices change with it"

    def _explain_node(self, name: str) -> str:
        node = self.problem.nodes[name]
        lines = [self._line(name), f"# {len(node.candidates)} candidates; cost around it with the neighbours' choices kept:"]
        for index, cand in enumerate(node.candidates):
            placement = f"({', '.join(text(i) for i in cand.inputs)}) -> {', '.join(text(o) for o in cand.outputs if o is not None)}"
            lines.append(f"  {placement:<40} {self._verdict(name, index)}")
        return "\n".join(lines)

    def _explain_against(self, placements: Mapping[str, Any]) -> str:
        lines = []
        for display, layout in placements.items():
            name = self._resolve(display)
            node = self.problem.nodes[name]
            if node.kind != "param":
                raise ValueError(f"Solution.explain: against= names {display!r}, which is not a parameter")
            layout = tuple(layout)
            chosen = self.choice(name).outputs[0]
            if layout == chosen:
                continue
            index = next((i for i, c in enumerate(node.candidates) if c.outputs[0] == layout), None)
            verdict = "not a candidate (it does not shard evenly)" if index is None else self._verdict(name, index)
            lines.append(f"{display}: {text(chosen)} here, {text(layout)} there: {verdict}")
        lines.append(f"# {len(lines)} of {len(placements)} parameters placed differently")
        return "\n".join(lines)
