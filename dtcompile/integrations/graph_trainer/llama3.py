"""graph_trainer's Llama3 configs (``torchtitan.experiments.graph_trainer.llama3.config_registry``),
with dtcompile's ``dtcompile`` pass pipeline registered::

    torchrun --nproc-per-node 8 -m torchtitan.train \
        --module dtcompile.integrations.graph_trainer.llama3 \
        --config graph_trainer_llama3_8b --compile.pass_pipeline dtcompile
"""

from __future__ import annotations

from typing import Any

from torchtitan.experiments.graph_trainer.llama3 import config_registry as _configs

import dtcompile.integrations.torchtitan  # noqa: F401 - registers the ``dtcompile`` pipeline

__all__ = [name for name in dir(_configs) if name.startswith("graph_trainer_")]


def __getattr__(name: str) -> Any:
    """graph_trainer's config function ``name`` (torchtitan's trainer looks it up by ``--config``)."""
    if name in __all__:
        return getattr(_configs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
