"""Inspection tools (issue #5: the ``dtcompile-report`` command); none yet."""

__all__: list[str] = []
