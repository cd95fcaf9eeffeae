"""Async tensor parallel: fuse an all-gather into the matmuls that consume it, and a matmul into its reduce-scatter.

The patterns are those DTensor's tensor + sequence parallelism leaves after
AOTAutograd (as in torch's ``micro_pipeline_tp.py``):

- all-gather: ``all_gather_into_tensor(x) -> wait`` gathers on dim 0; gathering
  on another dim ``d`` adds ``split(dim 0) -> cat(dim d)``.  Every consumer of
  the gathered tensor ``G`` of the form ``mm(view(G, [-1, K]), B)`` (or
  ``mm(G, B)`` for 2-D ``G``; ``addmm`` with a bias likewise) is fused: one
  ``dtcompile::fused_all_gather_matmul`` returns ``G`` and every product; each
  ``mm`` becomes a view of its product (plus the bias for ``addmm``).
- reduce-scatter: ``mm(A, B) -> view -> split(dim d) -> cat(dim 0) ->
  reduce_scatter_tensor -> wait`` (or ``mm -> reduce_scatter`` for ``d = 0``)
  becomes ``dtcompile::fused_matmul_reduce_scatter``, when every intermediate
  has that one user.

On CUDA a pair is fused only over an NCCL group, where the fused op takes
torch's symmetric-memory kernel: over another group (the fake process group)
the op would run decomposed, adding host time and overlapping nothing
(:func:`dtcompile.base.fused_ops.decomposed_on`).  Every fusion is priced under the
graph's cost profile (:class:`~dtcompile.records.Price`): it hides part of
the collective under the matmuls where the profile has fused kernels
(``fused_collective_matmul``), nothing where it has not (``cpu_gloo``) or
where no data moves (a 1-rank group), and a pair is fused only where that is
more than nothing.  CPU graphs priced for a GPU job (the fake and threaded test
worlds, ``h100`` under ``auto``) are fused and run the decomposition, which is
what CPU tests exercise.  ``force_async_tp`` fuses every eligible pair whatever
its price, for a run that must exercise the fused kernels where they save
nothing (a 1-rank NCCL group: the CUDA tests on one GPU); each such fusion's
record says it was forced and what the price said.  What the pass leaves, it
records with the reason.  The fused ops are in :mod:`dtcompile.base.fused_ops`
(symmetric-memory kernels on CUDA, a decomposed implementation elsewhere).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from dtcompile.base.fused_ops import decomposed_on  # importing it registers the dtcompile:: ops
from dtcompile.base.op_facts import MATMUL_RESHAPES
from dtcompile.base.sizes import is_symbolic
from dtcompile.cost import collective_time_us
from dtcompile.cost.simulate import fused_hidden_us, node_time_us
from dtcompile.graph.collectives import collective_info
from dtcompile.passes._graph import provenance, refresh_metadata, single_wait
from dtcompile.passes.context import PassContext
from dtcompile.records import Action, Outcome, Price

__all__ = ["fuse_async_tp"]


aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _gathered(wait: fx.Node) -> tuple[fx.Node, int] | None:
    """The gathered tensor and its gather dim: the wait itself (dim 0), or ``cat`` of its split."""
    users = list(wait.users)
    if len(users) == 1 and users[0].target is aten.split.Tensor and users[0].args[0] is wait:
        split = users[0]
        if (split.args[2] if len(split.args) > 2 else 0) != 0:
            return None
        getitems = list(split.users)
        cats = {u for g in getitems for u in g.users}
        if len(cats) != 1:
            return None
        (cat,) = cats
        if cat.target is not aten.cat.default or list(cat.args[0]) != sorted(getitems, key=lambda g: g.args[1]):
            return None
        dim = cat.args[1] if len(cat.args) > 1 else 0
        return _skip_full_slice(cat), dim % cat.meta["val"].dim()
    return _skip_full_slice(wait), 0


def _skip_full_slice(node: fx.Node) -> fx.Node:
    """Past value-preserving single users: ``slice(x, d, 0, n)`` over all of dim ``d``
    (DTensor's unpadding of even shards) and ``clone(x)`` (a contiguous copy)."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.target not in (aten.slice.Tensor, aten.clone.default) or "val" not in user.meta:
            break
        same_shape = user.meta["val"].shape == node.meta["val"].shape
        if same_shape and (user.target is aten.slice.Tensor or (user.target is aten.clone.default and user.args[0] is node)):
            node = user
            continue
        break
    return node


def _operands(mm: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(A, B)`` of ``mm(A, B)`` or ``addmm(bias, A, B)`` (plain, no alpha/beta)."""
    if mm.target is aten.mm.default:
        return mm.args[0], mm.args[1]
    if mm.target is aten.addmm.default and not mm.kwargs:
        return mm.args[1], mm.args[2]
    return None


def _matmul_consumers(gathered: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """``(mm, B)`` for each ``mm(view(G, [-1, K]), B)`` / ``mm(G, B)`` consumer of ``G``
    (``addmm(bias, ..., B)`` too: the bias is added to the fused product)."""
    found = []
    value = gathered.meta["val"]
    lhs = [gathered] if value.dim() == 2 else []
    lhs += [
        u
        for u in gathered.users
        if u.target in MATMUL_RESHAPES and u.meta["val"].dim() == 2 and u.meta["val"].shape[-1] == value.shape[-1]
    ]
    for operand in lhs:
        for mm in operand.users:
            pair = _operands(mm)
            if pair is not None and pair[0] is operand:
                found.append((mm, pair[1]))
    return found


def _hoist_before(node: fx.Node, anchor: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Move ``node`` (and the view-only chain it depends on) before ``anchor`` if it is after it.

    Only nodes computed from placeholders by views/permutes move; returns whether
    ``node`` is (now) before ``anchor``.
    """
    if order[node] < order[anchor]:
        return True
    if node.op != "call_function" or node.target not in (*MATMUL_RESHAPES, aten.permute.default, aten.t.default):
        return False
    if not all(_hoist_before(arg, anchor, order) for arg in node.all_input_nodes):
        return False
    anchor.prepend(node)
    order[node] = order[anchor] - 0.5
    return True


_SYMBOLIC = "its shape is symbolic (dynamic shapes), and the fused op is built for one shape"


def _price(ctx: PassContext, collective: fx.Node, matmuls: list[fx.Node]) -> Price:
    """What fusing saves: :func:`~dtcompile.cost.simulate.fused_hidden_us` (as
    :func:`~dtcompile.cost.simulate.simulate` plays a fused op), where the profile has
    fused kernels; the decomposition that runs elsewhere hides nothing."""
    profile = ctx.profile
    if not profile.fused_collective_matmul:
        return ctx.price(0.0, 0.0)
    info = collective_info(collective)
    c = collective_time_us(info.op, info.bytes, info.group_size, profile.link(info.group_span))
    m = sum(node_time_us(mm, profile) for mm in matmuls)
    return ctx.price(fused_hidden_us(c, m, info.group_size, profile), 0.0)


def _unpaid(ctx: PassContext, collective: fx.Node) -> str:
    """Why a fusion that does not pay saves nothing."""
    if not ctx.profile.fused_collective_matmul:
        return f"{ctx.profile.name} has no fused collective-matmul kernel (the op would run decomposed)"
    if collective_info(collective).group_size <= 1:
        return "its group has 1 rank: no data moves, so there is no communication to hide"
    return "the pipelined matmul hides none of the collective"


def _declined(ctx: PassContext, collective: fx.Node, price: Price) -> Outcome | None:
    """The skip of a fusion that does not pay, or None where it is applied: it pays, or
    ``force_async_tp`` asks for every eligible pair."""
    if price.pays or ctx.config.force_async_tp:
        return None
    return Outcome.skipped(collective.name, f"not fused: {_unpaid(ctx, collective)}", price)


def _forced(ctx: PassContext, collective: fx.Node, price: Price) -> str:
    """What a fusion's text adds under ``force_async_tp``: that it was forced, and whether the
    price would have fused it too (the price itself follows in the record's line); read
    before the rewrite erases ``collective``."""
    if not ctx.config.force_async_tp:
        return ""
    said = "it pays too" if price.pays else f"the price alone would not fuse it: {_unpaid(ctx, collective)}"
    return f"; forced by force_async_tp ({said})"


def _fuse_all_gather(gm: fx.GraphModule, ag: fx.Node, order: dict[fx.Node, int], ctx: PassContext) -> Outcome:
    wait = single_wait(ag)
    if wait is None:
        return Outcome.skipped(ag.name, "not fused: the all-gather has no single wait")
    if is_symbolic(wait.meta["val"]):
        return Outcome.skipped(ag.name, f"not fused: {_SYMBOLIC}")
    found = _gathered(wait)
    if found is None:
        return Outcome.skipped(ag.name, "not fused: the gathered tensor is rearranged in a way the pass does not know")
    gathered, gather_dim = found
    consumers = _matmul_consumers(gathered)
    if not consumers:
        return Outcome.skipped(ag.name, "not fused: no matmul consumes the gathered tensor as its left operand")
    ready = [b for _, b in consumers if _hoist_before(b, wait, order)]
    if len(ready) != len(consumers):
        return Outcome.skipped(ag.name, "not fused: a matmul's right operand is computed after the all-gather")
    shard, _, group = ag.args
    why = decomposed_on(shard.meta["val"].device.type, group)
    if why is not None:
        return Outcome.skipped(ag.name, f"not fused: {why}")
    price = _price(ctx, ag, [mm for mm, _ in consumers])
    declined = _declined(ctx, ag, price)
    if declined is not None:
        return declined
    forced = _forced(ctx, ag, price)
    graph = gm.graph
    with graph.inserting_before(wait):
        fused = graph.call_function(torch.ops.dtcompile.fused_all_gather_matmul.default, (shard, [b for _, b in consumers], gather_dim, group))
        a_gathered = graph.call_function(operator.getitem, (fused, 0))
        outs = graph.call_function(operator.getitem, (fused, 1))
    for node in (fused, a_gathered, outs):
        node.meta.update(provenance(ag))
    gathered.replace_all_uses_with(a_gathered)
    for i, (mm, _) in enumerate(consumers):
        with graph.inserting_before(mm):
            product = graph.call_function(operator.getitem, (outs, i))
            flat = graph.call_function(aten.reshape.default, (product, list(mm.meta["val"].shape)))
            made = [product, flat]
            if mm.target is aten.addmm.default:
                flat = graph.call_function(aten.add.Tensor, (flat, mm.args[0]))
                made.append(flat)
        for node in made:
            node.meta.update(provenance(mm))
        mm.replace_all_uses_with(flat)
        graph.erase_node(mm)
    _erase_unused([gathered, *_between(wait, gathered), wait, ag])
    return Outcome(Action.FUSED, f"fused all_gather(dim {gather_dim}) + {len(consumers)} matmul(s): {ag.name} -> {', '.join(mm.name for mm, _ in consumers)}{forced}", price=price)


def _fuse_reduce_scatter(gm: fx.GraphModule, rs: fx.Node, ctx: PassContext) -> Outcome:
    wait = single_wait(rs)
    if wait is None:
        return Outcome.skipped(rs.name, "not fused: the reduce-scatter has no single wait")
    if is_symbolic(rs.args[0].meta["val"]):
        return Outcome.skipped(rs.name, f"not fused: {_SYMBOLIC}")
    source, reduce_op, _, group = rs.args
    why = decomposed_on(source.meta["val"].device.type, group)
    if why is not None:
        return Outcome.skipped(rs.name, f"not fused: {why}")
    scatter_dim, produced = 0, source
    if source.target is aten.cat.default and (source.args[1] if len(source.args) > 1 else 0) == 0:
        getitems = list(source.args[0])
        splits = {g.args[0] for g in getitems if g.target is operator.getitem}
        if len(splits) != 1:
            return Outcome.skipped(rs.name, "not fused: the reduce-scatter input is not a split of one tensor")
        (split,) = splits
        if split.target is not aten.split.Tensor or len(split.users) != len(getitems):
            return Outcome.skipped(rs.name, "not fused: the reduce-scatter input is not a split of one tensor")
        produced = split.args[0]
        scatter_dim = (split.args[2] if len(split.args) > 2 else 0) % produced.meta["val"].dim()
        if len(produced.users) != 1:
            return Outcome.skipped(rs.name, f"not fused: {produced.name} has {len(produced.users)} users")
    view = produced
    mm = view.args[0] if view.target in MATMUL_RESHAPES else view
    if mm.target is not aten.mm.default:
        return Outcome.skipped(rs.name, f"not fused: its input comes from {mm.target} ({mm.name}), not from one matmul")
    if len(mm.users) != 1:
        return Outcome.skipped(rs.name, f"matmul->reduce-scatter not fused: the matmul output has {len(mm.users)} users")
    price = _price(ctx, rs, [mm])
    declined = _declined(ctx, rs, price)
    if declined is not None:
        return declined
    forced = _forced(ctx, rs, price)
    graph = gm.graph
    out_shape = list(view.meta["val"].shape)
    with graph.inserting_before(wait):
        fused = graph.call_function(
            torch.ops.dtcompile.fused_matmul_reduce_scatter.default,
            (mm.args[0], mm.args[1], out_shape, reduce_op, scatter_dim, group),
        )
        result = graph.call_function(aten.reshape.default, (fused, list(wait.meta["val"].shape)))
    for node in (fused, result):
        node.meta.update(provenance(rs))
    wait.replace_all_uses_with(result)
    _erase_unused([wait, rs, source, *(source.all_input_nodes if source is not produced else ()), produced, view, mm])
    return Outcome(Action.FUSED, f"fused matmul + reduce_scatter(dim {scatter_dim}): {mm.name} -> {rs.name}{forced}", price=price)


def _between(start: fx.Node, end: fx.Node) -> list[fx.Node]:
    """The rearrangement nodes from ``start`` to ``end`` (both excluded), walked back from
    ``end``: split, getitem, cat, slice and clone, which take only chain nodes as inputs
    (:func:`_gathered` accepts no other)."""
    found: list[fx.Node] = []
    stack = [] if end is start else list(end.all_input_nodes)
    while stack:
        node = stack.pop()
        if node is not start and node not in found:
            found.append(node)
            stack += node.all_input_nodes
    return found


def _erase_unused(nodes: list[fx.Node]) -> None:
    """Erase the replaced nodes, consumers first (collectives and waits are not dead code to FX)."""
    pending = list(dict.fromkeys(nodes))
    progress = True
    while pending and progress:
        progress = False
        for node in list(pending):
            if not node.users and node.op == "call_function":
                node.graph.erase_node(node)
                pending.remove(node)
                progress = True


def fuse_async_tp(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: PassContext) -> fx.GraphModule:
    """See the module docstring."""
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    changed = False
    for node in list(graph.nodes):
        if node.target is c10d.all_gather_into_tensor.default:
            outcome = _fuse_all_gather(gm, node, order, ctx)
        elif node.target is c10d.reduce_scatter_tensor.default:
            outcome = _fuse_reduce_scatter(gm, node, ctx)
        else:
            continue
        if outcome.action is Action.FUSED:
            changed = True
            refresh_metadata(gm, example_inputs)  # the next match reads the new nodes' values
        ctx.record(outcome)
    if changed:
        graph.eliminate_dead_code()
        graph.lint()
    return gm
