"""The back half every front door shares: the stages from a traced graph to a compiled one.

- :mod:`~dtcompile.pipeline.graph_compile`: one Dynamo graph's compile (trace, partition,
  passes, lower, record) for the ``torch.compile`` backend;
- :mod:`~dtcompile.pipeline.step_pass`: dtcompile's pass on a whole-step graph
  (``compile_step``, graph_trainer's pipeline);
- :mod:`~dtcompile.pipeline.compile_log`: where a compile's records, fallbacks, cache
  hits and ranks' checks are kept, logged and emitted;
- the stages' parts: :mod:`~dtcompile.pipeline.partition` (the partitioner),
  :mod:`~dtcompile.pipeline.reshard` (FSDP's ``reshard_after_forward``),
  :mod:`~dtcompile.pipeline.recompute` (the activation budget),
  :mod:`~dtcompile.pipeline.lowering` (regions inlined before Inductor),
  :mod:`~dtcompile.pipeline.dynamo_output` (what Dynamo's outputs need put back).

It imports the passes, the ranks, the records and everything below them; the front
doors (:mod:`dtcompile.compiler`, :mod:`dtcompile.step`,
:mod:`dtcompile.integrations`) import it.
"""
