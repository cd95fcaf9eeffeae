"""What an FX graph holds, read off it: the facts every stage, pass and cost model builds on.

- :mod:`~dtcompile.graph.collectives`: each functional collective's kind, group, mesh
  axis and sizes (:class:`~dtcompile.graph.collectives.CollectiveInfo`), the graph's
  mesh axes;
- :mod:`~dtcompile.graph.regions`: the ``local_map`` region nodes and their bodies;
- :mod:`~dtcompile.graph.memory`: the graph's memory estimate (its live bytes node by
  node, its peak) and the memory plan a compile prices its passes with;
- :mod:`~dtcompile.graph.rank_dependence`: which sizes may differ from rank to rank
  (uneven shards, data-dependent sizes).

It imports :mod:`dtcompile.base` and :mod:`dtcompile.hops` only: no cost model, no
configuration, no compile state.
"""
