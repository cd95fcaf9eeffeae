"""A model the planner cannot trace on fake tensors gets a message naming the op, the model's line and why."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import dtcompile
from dtcompile.testing import fake_world


class GroupedFloat64(nn.Module):
    """``aten._grouped_mm`` in float64: its fake kernel (``torch._meta_registrations``) refuses the dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 8, 8, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, self.w, offs=torch.tensor([2, 4], dtype=torch.int32))


class BranchOnValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.proj(x)
        return x


def _line(model: type, text: str) -> str:
    lines, first = inspect.getsourcelines(model.forward)
    number = first + next(i for i, line in enumerate(lines) if text in line)
    return f"{__file__}:{number} in forward"


def _plan_error(model: nn.Module, x: torch.Tensor) -> str:
    with fake_world(4, (4,), ("tp",)) as mesh, pytest.raises(ValueError) as caught:
        dtcompile.auto_parallel.plan(model, mesh, (x,))
    return str(caught.value)


def test_an_op_whose_fake_kernel_refuses_its_inputs_is_named_with_the_models_line():
    message = _plan_error(GroupedFloat64(), torch.randn(4, 8, dtype=torch.float64))
    assert message.startswith(
        "auto_parallel: tracing the model on fake tensors failed in aten._grouped_mm.default, "
        f"at {_line(GroupedFloat64, '_grouped_mm(')}: `return torch._grouped_mm("
    ), message
    assert "float64" in message  # torch's own words
    assert f"aten._grouped_mm.default's fake kernel on this torch ({torch.__version__}) refuses these inputs" in message


def test_a_branch_on_a_tensors_values_is_named_with_the_models_line():
    message = _plan_error(BranchOnValues(), torch.randn(4, 8))
    assert message.startswith(
        "auto_parallel: tracing the model on fake tensors failed in aten._local_scalar_dense.default, "
        f"at {_line(BranchOnValues, 'x.sum() > 0')}: `if x.sum() > 0:`: DataDependentOutputException"
    ), message
    assert "which hold no values: a branch on a tensor's values" in message
    assert "fake kernel" not in message


def test_the_models_code_is_what_is_not_torch_dtcompile_or_pythons_own():
    import contextlib
    import os
    import sysconfig

    from dtcompile.base import notation

    library = [torch.__file__, notation.__file__, contextlib.__file__, "<frozen importlib._bootstrap>"]
    assert all(map(notation.is_library_file, library))
    installed = os.path.join(sysconfig.get_paths()["stdlib"], "site-packages", "transformers", "modeling.py")
    assert not any(map(notation.is_library_file, [__file__, installed, "<string>"]))  # (<string>: exec'd code)
