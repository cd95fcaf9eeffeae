"""Dynamo VariableTrackers and guards for DeviceMesh, Placement, ProcessGroup and DTensor.

Not built yet (issue #3): dtcompile currently relies on stock Dynamo's tracing of
these objects.
"""

__all__: list[str] = []
