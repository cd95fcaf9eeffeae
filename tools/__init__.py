"""dtcompile_tools (the source folder ``tools/``): ``dtcompile-report``, the HTML report of a
TORCH_TRACE directory (:mod:`dtcompile_tools.report`), and the pytest plugin
(:mod:`dtcompile_tools.pytest_plugin`).  Installed as ``dtcompile_tools`` so that
nothing installs a package called ``tools``."""

__all__: list[str] = []
