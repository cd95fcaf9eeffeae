"""What things cost: the one place dtcompile prices time, for the passes, the report and ``auto_parallel``.

- :mod:`~dtcompile.cost.formulas`: the alpha-beta time of a collective over a
  link, and :class:`HardwareProfile` (links, roofline, overlap); no graph, no file.
- :mod:`~dtcompile.cost.profiles`: the named profiles (built in, registered, saved
  on disk by :func:`dtcompile.calibrate`).
- :mod:`~dtcompile.cost.auto`: which profile ``cost_profile="auto"`` prices a graph with.
- :mod:`~dtcompile.cost.simulate`: a node's time on the roofline, a graph played on a
  compute and a communication stream.
- :mod:`~dtcompile.cost.calibrate`: this machine measured into a saved profile
  (a higher layer: it runs collectives; not imported here).
"""

from dtcompile.cost.auto import ProfileChoice, choose_profile
from dtcompile.cost.formulas import AUTO, HardwareProfile, LinkCost, collective_time_us
from dtcompile.cost.profiles import (
    PROFILES,
    get_profile,
    load_profile,
    lookup_profile,
    profile_dir,
    register_profile,
    save_profile,
)

__all__ = [
    "AUTO",
    "PROFILES",
    "HardwareProfile",
    "LinkCost",
    "ProfileChoice",
    "choose_profile",
    "collective_time_us",
    "get_profile",
    "load_profile",
    "lookup_profile",
    "profile_dir",
    "register_profile",
    "save_profile",
]
