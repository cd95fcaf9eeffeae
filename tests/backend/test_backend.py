"""The backend itself: registration, options, passes, config scoping, plain models."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dtcompile
from dtcompile.config import DTCompileConfig
from dtcompile.pass_names import PASS_NAMES
from dtcompile.passes import PASSES
from dtcompile.records import Stage


@pytest.mark.subprocess
def test_entry_point_works_in_fresh_process_without_import():
    script = textwrap.dedent(
        """
        import sys, torch
        assert "dtcompile" not in sys.modules
        f = torch.compile(lambda x: x.cos() * 2, backend="dtcompile", fullgraph=True)
        x = torch.randn(8)
        torch.testing.assert_close(f(x), x.cos() * 2)
        named = torch._dynamo.lookup_backend("dtcompile")
        print(len(named.records), named.records[0].kind)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "inference"]


def test_unknown_option_names_valid_ones():
    with pytest.raises(ValueError) as err:
        dtcompile.backend(inductr=False)
    assert str(err.value) == (
        "dtcompile.backend: unknown option(s) ['inductr']; valid options are "
        "['aot_cache', 'bucket_cap_bytes', 'check_ranks', 'check_ranks_timeout_s', 'cost_profile', 'disable_passes', 'eager_fallback', 'force_async_tp', 'inductor', 'inductor_config', "
        "'keep_gathered', 'memory_budget_bytes', 'overlap_memory_budget_bytes', 'report', 'reshard_after_forward', "
        "'trace_pass_graphs']"
    )


def test_unknown_pass_and_inductor_setting_are_rejected():
    with pytest.raises(ValueError, match=r"unknown passes \['overlapp'\]; the passes are \['annotate', 'async_tp', 'bucketing', 'optimizer_updates', 'overlap'\]"):
        dtcompile.backend(disable_passes={"overlapp"})
    with pytest.raises(ValueError, match=r"inductor_config has unknown settings \['no_such_knob'\]"):
        dtcompile.backend(inductor_config={"no_such_knob": 1})


def test_config_is_frozen_and_compares_by_value():
    config = DTCompileConfig(disable_passes=["annotate"])
    assert config == DTCompileConfig(disable_passes={"annotate"})
    with pytest.raises(AttributeError):
        config.inductor = False  # type: ignore[misc]


class Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.lin(x)).sum(-1)


@pytest.mark.parametrize("inductor", [False, pytest.param(True, marks=pytest.mark.inductor)], ids=["aot", "inductor"])
def test_plain_model_compiles_and_matches_eager(inductor):
    torch.manual_seed(0)
    model = Plain()
    x = torch.randn(3, 8)
    backend = dtcompile.backend(inductor=inductor)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = model(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want)
    for _ in range(3):
        compiled(x)
    assert counter.frame_count == 1
    assert [r.kind for r in backend.records] == ["forward", "backward"]
    # Each graph's compile seconds have Inductor's stage exactly where it lowered.
    for record in backend.records:
        assert (Stage.INDUCTOR in record.stages) == inductor, record.stages
        assert record.stages.get(Stage.INDUCTOR) is None or record.stages.get(Stage.INDUCTOR) > 0


def test_switched_off_pass_does_not_run_and_passes_log(caplog):
    backend_on = dtcompile.backend(inductor=False)
    backend_off = dtcompile.backend(inductor=False, disable_passes={"annotate"})
    x = torch.randn(4)
    with caplog.at_level(logging.INFO, logger="dtcompile.passes"):
        torch.compile(torch.sin, backend=backend_on)(x)
    torch._dynamo.reset()
    torch.compile(torch.sin, backend=backend_off)(x)
    on = backend_on.records[0].passes[-1]
    off = backend_off.records[0].passes[-1]
    assert [p.name for p in PASSES] == ["async_tp", "bucketing", "overlap", "optimizer_updates", "annotate"]
    assert tuple(p.name for p in PASSES) == PASS_NAMES  # config.py validates against these
    assert (on.name, on.ran, off.ran) == ("annotate", True, False)
    assert "inference: pass annotate: nodes 3 -> 3, collectives 0 -> 0" in caplog.text


@pytest.mark.models
def test_compiler_settings_change_only_inside_the_call():
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    seen = {}

    def spy(gm, example_inputs, config):
        seen["autograd_cache"] = functorch_config.enable_autograd_cache
        seen["max_fusion_size"] = inductor_config.max_fusion_size
        return gm

    before = (functorch_config.enable_autograd_cache, inductor_config.max_fusion_size)
    # aot_cache=False switches AOTAutograd's cache off for this backend's compiles only.
    backend = dtcompile.backend(inductor_config={"max_fusion_size": 7}, aot_cache=False)
    original = PASSES[0].fn
    try:
        object.__setattr__(PASSES[0], "fn", spy)
        torch.compile(torch.cos, backend=backend)(torch.randn(4))
    finally:
        object.__setattr__(PASSES[0], "fn", original)
    assert seen == {"autograd_cache": False, "max_fusion_size": 7}
    assert (functorch_config.enable_autograd_cache, inductor_config.max_fusion_size) == before


@pytest.mark.models
def test_demo_checks_numerics_and_prints_the_schedule(capsys):
    from dtcompile import demo

    assert demo.main(["--no-inductor"]) == 0
    out = capsys.readouterr().out
    assert "OK: compiled matches eager and the reference" in out
    assert "dt_inp = .redistribute(Spec(f32[2, 8, 64](S(1))), placements=(Replicate())) -> Spec(f32[2, 8, 64](R))" in out
    assert "total backward: 4 collectives, 16384 B per rank" in out
    assert "== graph breaks ==\nnone\n== recompiles ==\nnone" in out
