"""dynamo_vars: Dynamo support for DeviceMesh, Placement, ProcessGroup and the DTensor API.

Nothing happens at import: installed when the ``dtcompile`` backend is looked up
by name or built with ``dtcompile.backend()``; also
``dynamo_vars.install()`` / ``uninstall()``, or ``with dynamo_vars.enabled(): ...``.

One family per module: :mod:`~dynamo_vars.device_mesh`,
:mod:`~dynamo_vars.placements`, :mod:`~dynamo_vars.process_groups`,
:mod:`~dynamo_vars.dtensor_api`, :mod:`~dynamo_vars.dtensor_state`; readable guard failures in
:mod:`~dynamo_vars.guards`; every change to Dynamo is made (and undone) in
``dynamo_vars/_install.py``.
"""

from dynamo_vars._install import enabled, install, is_installed, on_uninstall, uninstall

__all__ = ["enabled", "install", "is_installed", "on_uninstall", "uninstall"]
