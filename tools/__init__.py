"""Inspection tools: ``dtcompile-report`` (:mod:`tools.report`), the HTML report of a TORCH_TRACE directory."""

__all__: list[str] = []
