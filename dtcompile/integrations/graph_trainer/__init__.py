"""graph_trainer's configs served with dtcompile's ``dtcompile`` pass pipeline registered, for
``torchrun -m torchtitan.train --module dtcompile.integrations.graph_trainer.<model>``.

torchtitan's trainer imports the module ``--module`` names (``<module>.config_registry``,
else the module itself) and calls the function ``--config`` names from it; nothing else in
its launch imports dtcompile.  Each module here imports
:mod:`dtcompile.integrations.torchtitan` (which registers the pipeline) and hands on
graph_trainer's own config functions for that model, unchanged:

- :mod:`~dtcompile.integrations.graph_trainer.llama3`: ``graph_trainer.llama3``'s
  (``graph_trainer_llama3_debugmodel_sdpa``, ``graph_trainer_llama3_8b``, ...).

``--compile.pass_pipeline dtcompile`` then selects dtcompile's pipeline.
"""
