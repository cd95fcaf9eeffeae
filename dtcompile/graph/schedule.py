"""A graph's schedule as a pass moves nodes earlier, with its live bytes (issue #70).

Overlap issues each collective earlier (:mod:`dtcompile.passes.overlap`): the node
moves to right after an earlier one, the nodes it crosses each run one place later
with its buffer alive, and the pass asks, before each move, the peak of the live
bytes over the stretch the node would cross.  Read off a list of positions, a move
shifts every position it crosses; a deep model's collective crosses about a quarter
of the graph, so its hoists cost the graph's length each, and the pass grew with
the square of the depth.

:class:`MovingSchedule` keeps the order and the live bytes in slots instead.  Every
node keeps the slot it had when the schedule was made; a moved node joins the slot
of the node it now runs after, right behind it.  The slots never move: a move
changes two slots' contents and adds its bytes over the whole slots between them
(a :class:`~dtcompile.graph.memory.LiveBytes` over the slots, each slot's value the
most bytes live at any of its nodes), and a node's place is the number of nodes in
the slots before its own (a Fenwick tree), plus its place in its slot.  Each
question and each move costs ``O(log n)`` and the length of the two slots it
touches: one node each, but for the nodes moved behind one node.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx

from dtcompile.graph.memory import LiveBytes

__all__ = ["MovingSchedule", "SlotCounts"]

_EMPTY = -(1 << 62)
"""The value of a slot whose node moved out and none moved in: never the peak (an
integer, so that a range of such slots still reads as one)."""


class SlotCounts:
    """How many nodes each of ``length`` slots holds (one each to start with), with the sum
    over the slots before one: a Fenwick tree, ``O(log n)`` each."""

    def __init__(self, length: int) -> None:
        tree = [0] * (length + 1)
        for i in range(1, length + 1):
            tree[i] += 1
            parent = i + (i & -i)
            if parent <= length:
                tree[parent] += tree[i]
        self._tree = tree

    def add(self, slot: int, num: int) -> None:
        tree, i = self._tree, slot + 1
        while i < len(tree):
            tree[i] += num
            i += i & -i

    def before(self, slot: int) -> int:
        """The nodes in the slots before ``slot``."""
        tree, i, total = self._tree, slot, 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total


class MovingSchedule:
    """The order of ``nodes`` and the bytes live while each runs (``curve``, the
    schedule's :attr:`~dtcompile.graph.memory.MemoryEstimate.curve`) as nodes move
    earlier (see the module docstring).  Exact: the bytes are integers, and every
    answer is what the list of positions, shifted at each move, would give.

    Overlap's moves touch only a slot's ends: a collective leaves a slot it is alone in,
    and joins the slot of the node it follows right behind the last node there (what runs
    after that node is not a moved collective).  Those cost ``O(log n)``; a move into
    or out of the middle of a slot costs that slot's length too."""

    def __init__(self, nodes: Sequence[fx.Node], curve: Sequence[int]) -> None:
        if len(nodes) != len(curve):
            raise ValueError(f"MovingSchedule: {len(nodes)} nodes but {len(curve)} live-byte values")
        self._slot = {node: i for i, node in enumerate(nodes)}
        self._nodes: list[list[fx.Node]] = [[node] for node in nodes]
        # A slot's nodes' bytes, each less the slot's offset: what LiveBytes added over the
        # whole slot since they were written, the slot's live bytes less its largest value.
        self._values: list[list[int]] = [[num] for num in curve]
        self._top: list[int | None] = list(curve)
        self._live = LiveBytes(curve)
        self._counts = SlotCounts(len(nodes))

    @property
    def peak(self) -> int:
        """The most bytes live while any node runs."""
        return self._live.peak

    def key(self, node: fx.Node) -> tuple[int, int]:
        """A key that sorts nodes in schedule order."""
        slot = self._slot[node]
        return slot, self._nodes[slot].index(node)

    def position(self, node: fx.Node) -> int:
        """Where ``node`` runs now: how many nodes run before it."""
        slot = self._slot[node]
        return self._counts.before(slot) + self._nodes[slot].index(node)

    def _offset(self, slot: int) -> int:
        top = self._top[slot]
        return 0 if top is None else self._live.get(slot) - top

    def _write(self, slot: int, offset: int, top: int | None) -> None:
        """Sets ``slot``'s largest value (``None``: empty), its values kept at ``offset``."""
        self._top[slot] = top
        self._live.assign(slot, [_EMPTY if top is None else top + offset])

    def peak_between(self, anchor: fx.Node, node: fx.Node) -> int:
        """The most bytes live from ``anchor`` up to ``node`` (not included, later)."""
        (first, i), (last, j) = self.key(anchor), self.key(node)
        if first == last:
            return max(self._values[first][i:j]) + self._offset(first)
        best = max(self._values[first][i:]) + self._offset(first)
        if first + 1 <= last - 1:
            best = max(best, self._live.max_over(first + 1, last - 1))
        if j:
            best = max(best, max(self._values[last][:j]) + self._offset(last))
        return best

    def move_after(self, node: fx.Node, anchor: fx.Node, num: int) -> None:
        """Moves ``node`` to right after ``anchor`` (earlier) with ``num`` bytes alive from
        there on: the nodes between run one place later with those bytes alive too, and
        ``node`` runs with ``anchor``'s bytes and its own."""
        (first, i), (last, j) = self.key(anchor), self.key(node)
        ahead, offset = self._values[first], self._offset(first)
        moved = ahead[i] + num  # less the offset, as the slot keeps it
        if first == last:
            ahead[i + 1 : j] = [v + num for v in ahead[i + 1 : j]]
            del ahead[j], self._nodes[first][j]
        else:
            behind, behind_offset = self._values[last], self._offset(last)
            behind[:j] = [v + num for v in behind[:j]]
            del behind[j], self._nodes[last][j]
            self._write(last, behind_offset, max(behind) if behind else None)
            self._counts.add(last, -1)
            if first + 1 <= last - 1:
                self._live.add(first + 1, last - 1, num)
            ahead[i + 1 :] = [v + num for v in ahead[i + 1 :]]
            self._counts.add(first, 1)
            self._slot[node] = first
        ahead.insert(i + 1, moved)
        self._nodes[first].insert(i + 1, node)
        # Right behind the slot's last node from another slot, as overlap moves: the slot's
        # other values are as they were.
        top = self._top[first]
        behind_last = first != last and i + 2 == len(ahead)
        self._write(first, offset, max(top, moved) if behind_last and top is not None else max(ahead))
