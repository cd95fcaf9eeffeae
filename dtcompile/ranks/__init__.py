"""What the ranks of a job must agree on, and where they meet to agree.

- :mod:`~dtcompile.ranks.pairing`: one collective as the ranks of its group must agree on
  it (:class:`~dtcompile.ranks.pairing.Scheduled`) and which of its sizes they share; the
  report reads ranks' logs by this rule too (it imports no torch);
- :mod:`~dtcompile.ranks.schedule`: what a rank compiled, as its peers compare it (a
  :class:`~dtcompile.ranks.schedule.Schedule`: its collectives, size for size, and what
  they were decided from), saved beside the compile cache;
- :mod:`~dtcompile.ranks.check`: the one ranks' check every entry runs
  (:class:`~dtcompile.ranks.check.RankChecker`), and
  :class:`~dtcompile.ranks.check.RanksDisagree` where ranks would not pair up;
- :mod:`~dtcompile.ranks.plans`: plans the ranks of a group settle on together (one
  rank's priced plan adopted by all), for passes whose decisions would otherwise read
  a rank's own sizes.

It imports the graph facts, the records, the configuration's cache keys and the base;
never a pass, a stage or a front door.
"""
