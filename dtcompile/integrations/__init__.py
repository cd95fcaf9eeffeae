"""dtcompile plugged into other projects' compilers (not through ``torch.compile``).

- :mod:`dtcompile.integrations.torchtitan`: a pass pipeline named ``dtcompile`` for
  torchtitan's ``graph_trainer``, which traces a whole training step as one graph;
- :mod:`dtcompile.integrations.graph_trainer`: graph_trainer's configs with that pipeline
  registered, for ``torchtitan.train``'s ``--module``.

Nothing here is imported by dtcompile's core; each module imports its project
lazily where it can.
"""
