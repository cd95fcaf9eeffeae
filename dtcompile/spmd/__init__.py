"""SPMD types on plain-tensor programs (torchtitan's ``spmd_types``): the types a graph's
values have per mesh axis, checked as dtcompile traces it.

- :mod:`~dtcompile.spmd.inference`: each node's types from its inputs' (``type_graph``),
  the rule table, the inputs' declared types;
- :mod:`~dtcompile.spmd.layouts`: the layouts a user declares (``spmd_types``' own
  annotations) read into those types;
- :mod:`~dtcompile.spmd.carry`: a compiled graph's outputs stamped with their types, and
  a call with inputs typed otherwise checked.

It imports :mod:`dtcompile.base` and :mod:`dtcompile.graph` only.
"""
