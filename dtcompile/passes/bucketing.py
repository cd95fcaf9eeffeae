"""Bucketing: independent collectives of one kind on one group become one collective.

Candidates are ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
``all_reduce`` issued through a single ``wait_tensor``.  Walking the graph in
order, a collective joins the open bucket of its key (op, group, group size,
dtype, reduce op) when

- the bucket can be issued after every member's input can exist and waited on
  before any member's result is used (``max(ready) < min(first use)``): then no
  member depends on another.  An input that is a view or copy of a value that
  exists earlier (a parameter prepared for its gather, as a whole-step graph
  does just before the gather) is ready where that value is: the bucket moves
  those views and copies up to itself (:func:`hoistable`);
- the bucket stays under ``config.bucket_cap_bytes``, counted as
  :class:`~dtcompile.CollectiveInfo` counts bytes (an all-gather's output, the
  input of the others): the bucket's buffer is the memory bucketing adds;
- the graph's estimated peak (:mod:`dtcompile.graph.memory`) stays within its
  memory budget (``config.memory_budget_bytes``, by default the peak as traced
  plus twice the largest module's gathered weights): a bucket is issued once its last input
  exists, so a gathered member's result is alive from there rather than from
  its own collective, a reduced member's input until there, and the bucket's
  buffers (its inputs concatenated, its result) at once;
- it pays under the graph's cost profile (:class:`~dtcompile.records.Price`):
  one collective instead of two saves a launch (``t(bucket) + t(member) -
  t(bucket + member)``, :func:`~dtcompile.cost.collective_time_us`), and
  costs the copies (the member's input read and written into the bucket's
  buffer, and a gathered member's result copied out of it, at the profile's
  ``memory_gbps``; the bucket's first member's too when the second joins) and
  the overlap lost by waiting: the collectives issued earlier now wait for
  the later input, and the compute in between could have hidden
  ``profile.overlap`` of their time.  A member that does not pay closes the
  bucket and opens the next one.

Nothing that communicates crosses an ordering barrier
(:func:`~dtcompile.base.op_facts.is_ordering_barrier`: P2P, c10d's own ops, a custom op
with effects): a bucket holds only members after the same barrier, and is issued after it.

What this rank priced is its own plan; the ranks of each group settle one
(:mod:`dtcompile.ranks.plans`: the first rank to compile the group's candidates
settles its plan, the others apply it), since the prices read this rank's own
shapes (compute, activations) and ranks fed batches of other sizes would bucket
differently.  A rank that applies another's plan builds each planned bucket from
what its ranks share (the graph's dependencies, the cap), records that it did, and
prices it for the records as it prices its own.

A bucket is issued right after its last input can be computed: inputs are
copied into one buffer (``dtcompile::pack_columns``; for a reduce-scatter, rank by
rank, so that each rank's chunk holds its piece of every input), one collective and
one wait run, and each member's result is its piece of the output, reshaped: a
gathered member's column is copied out contiguous, as the collective's own output
was (``dtcompile::unpack_columns``).  Both copies are ops of their own
(:mod:`dtcompile.base.bucket_ops`), so that Inductor compiles no kernel per member
and a model's repeated layers share their kernels.  Every decision,
taken or not, is recorded with its reason, and what it adds to the peak.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

import dtcompile.base.bucket_ops  # noqa: F401  (registers the dtcompile:: ops the buckets use)
from dtcompile.base.channels import Meta
from dtcompile.base.notation import format_bytes
from dtcompile.base.op_facts import is_ordering_barrier
from dtcompile.base.sizes import is_symbolic
from dtcompile.cache_keys import key_fields, profile_text
from dtcompile.cost import collective_time_us
from dtcompile.cost.simulate import node_time_us
from dtcompile.graph.collectives import CollectiveInfo, axis_name, collective_info
from dtcompile.graph.memory import PeakTracker
from dtcompile.passes._graph import (
    alias_roots,
    first_use_index,
    provenance,
    refresh_metadata,
    replace_uses,
    single_wait,
    written_args,
)
from dtcompile.passes.bucket_spans import BucketSpans, memory_spans
from dtcompile.passes.context import PassContext
from dtcompile.ranks.plans import GroupPlan, Plan
from dtcompile.ranks.schedule import short_digest
from dtcompile.records import Action, Outcome, Price

__all__ = ["bucket_collectives", "hoistable", "written_values"]


aten = torch.ops.aten
c10d = torch.ops._c10d_functional

_BUCKETABLE = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
}


@dataclass
class _Member:
    node: fx.Node
    wait: fx.Node
    value: Any
    """The fake value of its input, read before any rewrite: an earlier bucket's
    rewrite may replace that input with a slice of its own result, which has no
    fake value until the pass ends."""
    ready: int
    """Where its input can first be computed (:func:`hoistable`): its own place, or earlier."""
    first_use: int
    info: CollectiveInfo
    source_at: int
    """Where its input is computed now; a bucket that needs it earlier (``ready`` before it)
    moves its views and copies up."""
    copied_bytes: int = 0
    """The bytes of the copies among the ops moved up with its input (views move for free): alive longer."""
    barrier: fx.Node | None = None
    """The last ordering barrier before it (:func:`~dtcompile.base.op_facts.is_ordering_barrier`):
    its bucket is issued after that, and holds only members after the same barrier."""
    epoch: int = 0
    """How many ordering barriers come before it: members of one bucket share it."""

    @property
    def key(self) -> tuple[Any, ...]:
        """Its bucket's key: op, group, group size, dtype, reduce op and :attr:`epoch`."""
        return (*_key(self.node), self.epoch)

    @property
    def num_bytes(self) -> int:
        """As :class:`~dtcompile.CollectiveInfo` counts them: an all-gather's gathered buffer, the others' input."""
        return self.info.bytes


@dataclass
class _Bucket:
    key: tuple[Any, ...]
    members: list[_Member] = field(default_factory=list)
    prices: list[Price] = field(default_factory=list)
    """What each member after the first saved and cost when it joined."""
    ready: int = field(init=False)
    """Where it can be issued: its members' latest ``ready`` (kept as they join, as are
    the two below: a join reads them, and a bucket can hold a tenth of a graph's collectives)."""
    first_use: int = field(init=False)
    num_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.ready = max(m.ready for m in self.members)
        self.first_use = min(m.first_use for m in self.members)
        self.num_bytes = sum(m.num_bytes for m in self.members)

    def add(self, member: _Member, price: Price) -> None:
        self.members.append(member)
        self.prices.append(price)
        self.ready = max(self.ready, member.ready)
        self.first_use = min(self.first_use, member.first_use)
        self.num_bytes += member.num_bytes


_COPIES_OPS = frozenset({aten.clone.default, aten._to_copy.default, aten.contiguous.default})


def _movable(node: fx.Node) -> bool:
    """A cheap node that can run earlier: a view, or a copy (``clone``, ``_to_copy``) of a
    value, as a parameter is prepared for its gather.  Compute stays where it is: moving
    it would change the schedule the other passes and the memory estimate price."""
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return _movable(node.args[0]) if isinstance(node.args[0], fx.Node) else False
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten" or target._schema.is_mutable:
        return False
    returns = target._schema.returns
    is_view = len(returns) == 1 and returns[0].alias_info is not None
    return is_view or target in _COPIES_OPS


def _bytes(node: fx.Node) -> int:
    value = node.meta.get("val")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) and not is_symbolic(value) else 0


def written_values(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose storage some node of ``graph`` writes in place (an optimizer's update):
    the written values and every view of them."""
    roots = alias_roots(graph)
    written = {roots[w] for node in graph.nodes for w in written_args(node)}
    return {node for node in graph.nodes if roots[node] in written}


def hoistable(source: fx.Node, written: set[fx.Node] = frozenset()) -> tuple[fx.Node, list[fx.Node]]:
    """``(anchor, chain)``: ``source`` can be computed right after ``anchor`` by running
    ``chain`` (the movable ops it is made by, in graph order) there; ``source`` itself
    and no chain when it is not movable.  An op that reads a value written in place
    (``written``, :func:`written_values`) is not moved: it must stay on its side of the write.
    Graph order is the nodes' own (``fx.Node`` compares by its place in the graph, kept as
    nodes are inserted and moved), not positions counted before a rewrite."""
    chain: set[fx.Node] = set()
    frontier: set[fx.Node] = set()
    stack = [source]
    while stack:
        node = stack.pop()
        if node in chain or node in frontier:
            continue
        if _movable(node) and not any(w in written for w in node.all_input_nodes):
            chain.add(node)
            stack.extend(node.all_input_nodes)
        else:
            frontier.add(node)
    if not frontier:  # made of constants only: where it is
        return source, []
    return max(frontier), sorted(chain)


def _key(node: fx.Node) -> tuple[Any, ...]:
    kind = _BUCKETABLE[node.target]
    value = node.args[0].meta["val"]
    if kind == "all_gather":
        _, group_size, group = node.args
        return (kind, group, group_size, value.dtype, None)
    if kind == "reduce_scatter":
        _, reduce_op, group_size, group = node.args
        return (kind, group, group_size, value.dtype, reduce_op)
    _, reduce_op, group = node.args
    return (kind, group, None, value.dtype, reduce_op)


_COPIES = "of copies"
_COPIES_AND_DELAY = "of copies and delayed overlap"


class _Pricer:
    """Prices a member joining a bucket under the graph's profile (see the module docstring)."""

    def __init__(self, graph: fx.Graph, ctx: PassContext) -> None:
        self.graph = graph
        self.ctx = ctx
        self.profile = ctx.profile

    @functools.cached_property
    def clock(self) -> list[float]:
        """Estimated compute time up to each node (graph order), for the overlap a bucket
        delays; played once, on the first join priced."""
        return list(itertools.accumulate((node_time_us(n, self.profile) for n in self.graph.nodes), initial=0.0))

    def time_us(self, member: _Member, num_bytes: int) -> float:
        info = member.info
        return collective_time_us(info.op, num_bytes, info.group_size, self.profile.link(info.group_span))

    def copies_us(self, member: _Member) -> float:
        """Its input read and written into the buffer; a gathered result copied out of it."""
        moved = 2 * member.value.numel() * member.value.element_size()
        if member.info.op == "all_gather":
            moved += 2 * member.num_bytes
        return self.profile.memory_time_us(moved)

    def join(self, bucket: _Bucket, member: _Member) -> Price:
        t_bucket, t_member = self.time_us(member, bucket.num_bytes), self.time_us(member, member.num_bytes)
        saves = t_bucket + t_member - self.time_us(member, bucket.num_bytes + member.num_bytes)
        copies = self.copies_us(member) + (self.copies_us(bucket.members[0]) if len(bucket.members) == 1 else 0.0)
        # Whichever is ready first now waits for the other: the compute in between
        # could have hidden (overlap of) its collective's time.
        if member.ready > bucket.ready:
            waiting, between = t_bucket, self.clock[member.ready] - self.clock[bucket.ready]
        else:
            waiting, between = t_member, self.clock[bucket.ready] - self.clock[member.ready]
        delay = self.profile.overlap * min(waiting, between)
        return self.ctx.price(saves, copies + delay, _COPIES_AND_DELAY if delay else _COPIES)


def _candidates(graph: fx.Graph, index: dict[fx.Node, int], ctx: PassContext | None) -> list[_Member]:
    """The collectives that may join a bucket, in graph order; each one left out is recorded
    (where ``ctx`` is given) with why."""
    found = []
    barrier, epoch = None, 0
    for node in graph.nodes:
        if is_ordering_barrier(node):
            barrier, epoch = node, epoch + 1
            continue
        if node.target not in _BUCKETABLE:
            continue
        wait = single_wait(node)
        source = node.args[0]
        if wait is None or not isinstance(source, fx.Node) or "val" not in source.meta:
            if ctx is not None:
                ctx.skipped(node.name, "not bucketed: not a single collective + wait")
            continue
        value = source.meta["val"]
        if is_symbolic(value):
            if ctx is not None:
                ctx.skipped(node.name, "not bucketed: its shape is symbolic (dynamic shapes); a bucket is built for one shape")
            continue
        # Issued after the last barrier before it, whatever its input's place.
        ready = max(index[source], index[barrier] if barrier is not None else -1)
        found.append(_Member(node, wait, value, ready, first_use_index(wait, index), collective_info(node), index[source],
                             barrier=barrier, epoch=epoch))
    return found


def _independent(bucket: _Bucket, member: _Member, index: dict[fx.Node, int], written: set[fx.Node]) -> bool:
    """Whether ``member`` can join ``bucket`` without depending on it: issued after every
    input can exist and waited on before any result is used, its input's views and copies
    moved up to the bucket where that makes it so (then ``member`` says so)."""
    if max(bucket.ready, member.ready) < min(bucket.first_use, member.first_use):
        return True
    anchor, chain = hoistable(member.node.args[0], written)
    ready = max(index[anchor], index[member.barrier] if member.barrier is not None else -1)
    if max(bucket.ready, ready) < min(bucket.first_use, member.first_use):
        member.ready = ready
        member.copied_bytes = sum(_bytes(n) for n in chain if n.target in _COPIES_OPS)
        return True
    return False


def _group_candidates(members: Sequence[_Member]) -> dict[Any, list[_Member]]:
    """The candidates by process group, each group's in graph order: what its ranks plan over."""
    by_group: dict[Any, list[_Member]] = {}
    for member in members:
        by_group.setdefault(member.key[1], []).append(member)
    return by_group


def _described(members: Sequence[_Member]) -> str:
    """A group's candidates as every rank of it describes them alike (no node names)."""
    return "\n".join(f"{i}: {'/'.join(map(str, m.key[::2]))} {m.num_bytes} B @{m.epoch}" for i, m in enumerate(members))


def _plan_of(buckets: Sequence[_Bucket], members: Sequence[_Member]) -> Plan:
    ordinal = {m.node: i for i, m in enumerate(members)}
    return tuple(tuple(ordinal[m.node] for m in b.members) for b in buckets if len(b.members) > 1 and b.members[0].node in ordinal)


def bucket_collectives(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: PassContext) -> fx.GraphModule:
    """See the module docstring."""
    graph = gm.graph
    index = {node: i for i, node in enumerate(graph.nodes)}
    written = written_values(graph)
    pricer = _Pricer(graph, ctx)
    tracker = ctx.peak_tracker(gm)
    candidates = _candidates(graph, index, ctx)
    closed, added = _priced_buckets(candidates, index, written, pricer, tracker, ctx)
    # What this rank priced from its own shapes becomes a plan each group's ranks settle
    # (dtcompile.ranks.plans): where a peer's plan is adopted, the buckets follow it.
    by_group = _group_candidates(candidates)
    mine = [
        GroupPlan(str(group), _described(members), _plan_of(closed, members), axis_name(str(group), ctx.info.axes))
        for group, members in by_group.items()
    ]
    # Settled per graph kind and settings: ranks (or compiles) given other options or
    # another profile decide for themselves, and the ranks' check names what differs.
    settings = short_digest(f"{key_fields(ctx.config)}\n{profile_text(ctx.profile)}")
    agreed = ctx.plans.agree(f"bucketing/{ctx.kind}/{settings}", mine)
    if any(a.plan != m.plan for a, m in zip(agreed, mine)):
        fresh = _group_candidates(_candidates(graph, index, None))
        closed, followed = [], []
        for own, settled in zip(mine, agreed):
            members = fresh[next(g for g in fresh if str(g) == own.group)]
            followed += _followed_buckets(members, settled.plan, index, written, ctx.config.bucket_cap_bytes, pricer)
            if settled.plan != own.plan:
                ctx.record(Outcome(Action.AGREED, settled.describe("bucket plan"), "graph"))
        closed = followed
        tracker = ctx.peak_tracker(gm)
        added = {}
        for bucket in closed:
            before = tracker.peak
            tracker.commit(memory_spans(bucket.members, index, tracker))
            added[id(bucket)] = tracker.peak - before
    # The graph's output reads every bucket's results (a backward's gradients): it is
    # rewritten once, for every bucket, at the end (rewriting it for each bucket costs the
    # buckets times its length); the replaced collectives and waits go then too.
    output = next(iter(graph.find_nodes(op="output")))
    replaced: dict[fx.Node, fx.Node] = {}
    # Rewritten in graph order of their last members, whichever way they were made: two
    # buckets issued after one node end up in an order of the rewrites, which must be every
    # rank's, whether it priced the plan or followed a peer's.
    for bucket in sorted(closed, key=lambda b: index[b.members[-1].node]):
        if len(bucket.members) < 2:
            continue
        # The last input as the graph is now: a bucket that reduces the results of
        # an earlier one (an all-reduce over dp of all-reduces over ep) reads that
        # bucket's slices, which replaced the waits it was collected after.
        replaced.update(_rewrite(gm, bucket, _hoist(bucket, written), output))
        names = ", ".join(m.node.name for m in bucket.members)
        kind = bucket.key[0]
        saves, costs = sum(p.saves_us for p in bucket.prices), sum(p.costs_us for p in bucket.prices)
        what = _COPIES_AND_DELAY if any(p.costs_what == _COPIES_AND_DELAY for p in bucket.prices) else _COPIES
        price = ctx.price(saves, costs, what, added[id(bucket)])
        ctx.bucketed(f"{kind}[{len(bucket.members)} -> 1]: {names} ({bucket.num_bytes} B)", price)
    replace_uses(replaced)  # only the output reads them now
    for wait in replaced:
        (collective,) = wait.all_input_nodes
        graph.erase_node(wait)
        graph.erase_node(collective)
    graph.eliminate_dead_code()
    graph.lint()
    refresh_metadata(gm, example_inputs)
    return gm


def _followed_buckets(
    members: Sequence[_Member], plan: Plan, index: dict[fx.Node, int], written: set[fx.Node], cap: int, pricer: _Pricer
) -> list[_Bucket]:
    """The buckets of ``plan`` (settled by the group's ranks) over this rank's ``members``:
    each planned bucket's members join in order where they are independent and fit the cap
    (facts of the graph's structure and the collectives' bytes, which its ranks share), so
    every rank splits a bucket it cannot build alike; the others stay alone."""
    buckets: list[_Bucket] = []
    planned: set[int] = set()
    for ordinals in plan:
        bucket: _Bucket | None = None
        for i in ordinals:
            if not 0 <= i < len(members) or i in planned:
                raise AssertionError(f"dtcompile: a settled bucket plan names candidate {i} of {len(members)} twice or "
                                     "out of range; please report this")
            planned.add(i)
            member = members[i]
            if bucket is not None and bucket.key == member.key and (
                member.num_bytes + bucket.num_bytes <= cap and _independent(bucket, member, index, written)
            ):
                bucket.add(member, pricer.join(bucket, member))
                continue
            if bucket is not None:
                buckets.append(bucket)
            bucket = _Bucket(member.key, [member])
        if bucket is not None:
            buckets.append(bucket)
    buckets += [_Bucket(m.key, [m]) for i, m in enumerate(members) if i not in planned]
    return buckets


def _priced_buckets(
    candidates: Sequence[_Member],
    index: dict[fx.Node, int],
    written: set[fx.Node],
    pricer: _Pricer,
    tracker: PeakTracker,
    ctx: PassContext,
) -> tuple[list[_Bucket], dict[int, int]]:
    """This rank's buckets, priced from its own graph (see the module docstring), and the
    bytes each adds to the peak (by ``id``)."""
    open_buckets: dict[tuple[Any, ...], _Bucket] = {}
    closed: list[_Bucket] = []
    added: dict[int, int] = {}
    # The live bytes with every bucket's spans added, the open ones' too (``tracker`` holds
    # the closed ones'), and each open bucket's spans as added there.  Pricing a join then
    # changes only what the join changes, over the positions it changes (the difference of
    # the bucket's spans before and after): the peak with the open buckets as they are, but
    # the joining key's made of other members, exactly as a whole walk of the schedule
    # would find it.
    pending = tracker.live.copy()
    spans_of: dict[tuple[Any, ...], BucketSpans] = {}

    def close(bucket: _Bucket) -> None:
        before = tracker.peak
        del spans_of[bucket.key]  # its spans stay in ``pending``
        tracker.commit(memory_spans(bucket.members, index, tracker))
        added[id(bucket)] = tracker.peak - before
        closed.append(bucket)

    for member in candidates:
        node = member.node
        key = member.key
        bucket = open_buckets.get(key)
        if bucket is not None:
            fits = member.num_bytes + bucket.num_bytes <= ctx.config.bucket_cap_bytes
            independent = _independent(bucket, member, index, written)
            price = pricer.join(bucket, member) if fits and independent else None
            if price is not None:
                now = max(pending.peak, 0)
                spans_of[key].join(member)
                then = max(pending.peak, 0)
                price = dataclasses.replace(price, adds_bytes=then - now)
                if price.pays and then <= tracker.budget:
                    spans_of[key].keep()
                    bucket.add(member, price)
                    continue
                spans_of[key].undo()
            if price is not None and price.pays:
                ctx.skipped(
                    node.name,
                    f"starts a new bucket: joining {bucket.members[-1].node.name}'s would take the estimated peak "
                    f"to {format_bytes(then)}, over the memory budget {format_bytes(tracker.budget)} ({ctx.budget_why})",
                    price,
                )
            elif price is not None:
                ctx.skipped(node.name, f"starts a new bucket: joining {bucket.members[-1].node.name}'s does not pay", price)
            else:
                why = "the bucket would pass bucket_cap_bytes" if not fits else (
                    "its input is computed after a bucketed result is used (they depend on each other)"
                )
                ctx.skipped(node.name, f"starts a new bucket: {why}")
            del open_buckets[key]
            close(bucket)
        open_buckets[key] = _Bucket(key, [member])
        spans_of[key] = BucketSpans(pending, index, tracker, member)  # none added: one member adds nothing
    for bucket in list(open_buckets.values()):
        close(bucket)
    return closed, added


def _hoist(bucket: _Bucket, written: set[fx.Node]) -> fx.Node:
    """Where the bucket is issued: after the last node its inputs need; the ops that compute
    an input later than that are moved up there.  Returns the node the bucket goes after."""
    found = [
        hoistable(m.node.args[0], written) if m.ready < m.source_at else (m.node.args[0], [])
        for m in bucket.members
    ]
    floors = [m.barrier for m in bucket.members if m.barrier is not None]
    at = max([anchor for anchor, _ in found] + floors)
    cursor = at
    for node in sorted({n for _, chain in found for n in chain if n > at}):
        cursor.append(node)
        cursor = node
    return cursor


def _rewrite(gm: fx.GraphModule, bucket: _Bucket, after: fx.Node, output: fx.Node) -> dict[fx.Node, fx.Node]:
    """The bucket as one collective issued right after ``after``, every reader of a member's
    wait but ``output`` reading its piece of the result instead; returns each member's wait
    -> its piece, for the caller to rewrite ``output`` with and to erase the members."""
    graph = gm.graph
    kind, group, group_size, _, reduce_op, _ = bucket.key
    values = [m.value for m in bucket.members]
    numels = [v.numel() for v in values]
    # New nodes go in order, right after the last input; for the annotations each
    # stands for the bucket's first member (its DTensor op) and names the bucket.
    first = bucket.members[0].node
    meta = {**provenance(first), Meta.BUCKET: tuple(m.node.name for m in bucket.members)}
    cursor = _Cursor(graph, after, meta)
    # The copies in and out are dtcompile's ops (dtcompile.base.bucket_ops): as aten's cat,
    # slice and reshape, Inductor would write each member's offset into a kernel of its own.
    inputs = [m.node.args[0] for m in bucket.members]
    if kind == "reduce_scatter":
        # Rank r's chunk holds its rows of each input (each input [n, numel / n], side by side).
        buffer = cursor(torch.ops.dtcompile.pack_columns.default, (inputs, group_size))
        out = cursor(c10d.reduce_scatter_tensor.default, (buffer, reduce_op, group_size, group))
        pieces = [n // group_size for n in numels]
    else:
        buffer = cursor(torch.ops.dtcompile.pack_columns.default, (inputs, 1))
        if kind == "all_gather":
            out = cursor(c10d.all_gather_into_tensor.default, (buffer, group_size, group))
        else:
            out = cursor(c10d.all_reduce.default, (buffer, reduce_op, group))
        pieces = numels
    waited = cursor(c10d.wait_tensor.default, (out,))
    shapes = [list(v.shape) for v in values]
    offsets = list(itertools.accumulate(pieces, initial=0))[:-1]
    copied: dict[int, fx.Node] = {}  # member -> its copy out of the gathered result
    if kind == "all_gather":
        for shape in shapes:
            shape[0] *= group_size
        waited = cursor(aten.reshape.default, (waited, [group_size, -1]))
        # A gathered member is a column of the [group_size, total] result, copied out unless
        # it is the whole result or the result is one row (a view of it then).
        total = sum(pieces)
        apart = [i for i, piece in enumerate(pieces) if not (group_size == 1 or piece == total or piece == 0)]
        if apart:
            unpacked = cursor(
                torch.ops.dtcompile.unpack_columns.default,
                (waited, [offsets[i] for i in apart], [pieces[i] for i in apart]),
            )
            copied = {i: cursor(operator.getitem, (unpacked, j)) for j, i in enumerate(apart)}
    elif kind == "reduce_scatter":
        for shape in shapes:
            shape[0] //= group_size
    dim = 1 if kind == "all_gather" else 0  # where a member's piece lies in the result
    results: dict[fx.Node, fx.Node] = {}
    for i, (member, piece, offset, shape) in enumerate(zip(bucket.members, pieces, offsets, shapes)):
        if i in copied:
            results[member.wait] = cursor(aten.reshape.default, (copied[i], shape))  # a view of its copy
            continue
        part = cursor(aten.slice.Tensor, (waited, dim, offset, offset + piece))
        results[member.wait] = cursor(aten.reshape.default, (part, shape))
    replace_uses(results, keep={output})
    return results


class _Cursor:
    """Appends call_function nodes one after the other, starting after ``node``, with ``meta``."""

    def __init__(self, graph: fx.Graph, node: fx.Node, meta: dict[str, Any]) -> None:
        self.graph = graph
        self.last = node
        self.meta = meta

    def __call__(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> fx.Node:
        with self.graph.inserting_after(self.last):
            self.last = self.graph.call_function(target, args, kwargs)
        self.last.meta.update(self.meta)
        return self.last
