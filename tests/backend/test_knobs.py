"""torch.compile's own knobs (``mode=``, ``options=``) and the config: validated, frozen, hashable."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import fx

import dtcompile
from dtcompile._testing.cases import pass_context
from dtcompile.base.channels import Artifact, GraphKind
from dtcompile.cache_keys import key_fields
from dtcompile.config import DTCompileConfig
from dtcompile.pass_names import PassSpec, Stage
from dtcompile.passes import GraphPass, run_passes


def _named():
    return torch._dynamo.lookup_backend("dtcompile")


def _compile_and_check(**compile_kwargs):
    """Compiles a small pointwise function with the named backend; returns its new records and warnings."""
    def fn(x):
        return torch.sin(x) * 2 + 1

    backend = _named()
    start = len(backend.records)
    x = torch.randn(16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="dtcompile", **compile_kwargs)(x)
    torch.testing.assert_close(out, fn(x))
    messages = [str(w.message) for w in caught if "dtcompile" in str(w.message)]
    return list(backend.records)[start:], messages


@pytest.mark.inductor
def test_mode_max_autotune_reaches_inductor_and_says_what_cpu_ignores():
    records, messages = _compile_and_check(mode="max-autotune")
    (record,) = records
    assert record.lowering == {"max_autotune": True, "coordinate_descent_tuning": True}
    assert messages == [
        "dtcompile: ignored triton.cudagraphs (mode='max-autotune' asks for CUDA graphs; this graph runs on cpu)"
    ]


@pytest.mark.inductor
def test_mode_reduce_overhead_on_cpu_is_one_warning():
    records, messages = _compile_and_check(mode="reduce-overhead")
    (record,) = records
    assert record.lowering == {}
    assert messages == [
        "dtcompile: ignored triton.cudagraphs (mode='reduce-overhead' asks for CUDA graphs; this graph runs on cpu)"
    ]


def test_options_set_dtcompile_fields_and_inductor_settings():
    counters = torch._dynamo.utils.counters
    before = dict(counters["inductor"])
    records, messages = _compile_and_check(options={"inductor": False, "max_autotune": True})
    (record,) = records
    assert record.lowering == {}  # not lowered by Inductor ...
    assert dict(counters["inductor"]) == before  # ... which did not run
    assert messages == [
        "dtcompile: ignored Inductor settings ['max_autotune'] (inductor=False: the graphs are not lowered by Inductor)"
    ]
    records, _ = _compile_and_check(options={"inductor": False, "disable_passes": {"overlap"}})
    assert [p.name for p in records[0].passes if not p.ran] == ["overlap"]


def test_unknown_options_and_modes_name_the_valid_ones():
    with pytest.raises(Exception, match=r"torch.compile options \['no_such_knob'\] are neither dtcompile options nor Inductor settings; dtcompile's options are \['aot_cache', 'bucket_cap_bytes'"):
        _compile_and_check(options={"no_such_knob": 1})
    with pytest.raises(Exception, match=r"unknown torch.compile mode 'fastest'; the modes are"):
        torch.compile(lambda x: x + 1, backend="dtcompile", mode="fastest")(torch.ones(2))


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"bucket_cap_bytes": -1}, ValueError, "bucket_cap_bytes must be >= 1 bytes, got -1"),
        ({"overlap_memory_budget_bytes": -1}, ValueError, "overlap_memory_budget_bytes must be >= 0 bytes, got -1"),
        ({"bucket_cap_bytes": "256MB"}, TypeError, "bucket_cap_bytes must be a number of bytes (int), got str '256MB'"),
        ({"bucket_cap_bytes": True}, TypeError, "bucket_cap_bytes must be a number of bytes (int), got bool True"),
        ({"disable_passes": "bucketing"}, TypeError, "disable_passes must be a set of pass names, got str 'bucketing'; write {'bucketing'} for one pass"),
        ({"inductor": "false"}, TypeError, "inductor must be True or False, got str 'false'"),
        ({"report": 1}, TypeError, "report must be True or False, got int 1"),
        ({"eager_fallback": "no"}, TypeError, "eager_fallback must be True or False, got str 'no'"),
        ({"aot_cache": None}, TypeError, "aot_cache must be True or False, got NoneType None"),
        ({"cost_profile": 3}, TypeError, "cost_profile must be a profile name (str), 'auto' or a dtcompile.cost.HardwareProfile, got int 3"),
        ({"inductor_config": {"triton": {"cudagraphs": True}}}, ValueError, "inductor_config has nested mappings under ['triton']; give nested settings by dotted name"),
        ({"inductor_config": ["max_autotune"]}, TypeError, "inductor_config must be a mapping of torch._inductor.config settings"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else None,
)
def test_every_field_is_validated_by_type_and_range(options, error, message):
    with pytest.raises(error) as err:
        dtcompile.backend(**options)
    assert message in str(err.value)


def test_dotted_inductor_settings_are_accepted():
    config = DTCompileConfig(inductor_config={"triton.cudagraphs": False, "max_autotune": False})
    assert dict(config.inductor_config) == {"triton.cudagraphs": False, "max_autotune": False}


def test_config_is_really_frozen_and_hashable():
    config = DTCompileConfig(inductor_config={"max_autotune": True}, disable_passes=["overlap"])
    with pytest.raises(TypeError):
        config.inductor_config["max_autotune"] = False  # type: ignore[index]
    with pytest.raises(AttributeError):
        config.report = True  # type: ignore[misc]
    same = DTCompileConfig(inductor_config={"max_autotune": True}, disable_passes={"overlap"})
    assert config == same and hash(config) == hash(same)
    assert len({config, same, DTCompileConfig()}) == 2


def test_each_field_declares_its_check_and_whether_the_caches_key_on_it():
    """The checks, the hash and the compile caches' key iterate the fields' own declarations:
    a field added without them is an error here, not a check or a key silently missing."""
    fields = dataclasses.fields(DTCompileConfig)
    assert all(callable(f.metadata.get("check")) for f in fields)
    assert all(isinstance(f.metadata.get("in_key"), bool) for f in fields)
    shown_or_met = {"report", "trace_pass_graphs", "eager_fallback", "aot_cache", "check_ranks", "check_ranks_timeout_s"}
    assert set(DTCompileConfig.key_field_names()) == set(DTCompileConfig.field_names()) - shown_or_met
    assert set(key_fields(DTCompileConfig())) == set(DTCompileConfig.key_field_names())
    # A field off the key changes no key; one on it does.
    assert key_fields(DTCompileConfig(report=True)) == key_fields(DTCompileConfig())
    assert key_fields(DTCompileConfig(bucket_cap_bytes=1)) != key_fields(DTCompileConfig())
    # Every field is hashed: configs that differ in any one field (most of them) hash apart.
    other = {"inductor": False, "bucket_cap_bytes": 1, "check_ranks_timeout_s": 1.0, "inductor_config": {"max_autotune": True}}
    assert len({hash(DTCompileConfig(**{name: value})) for name, value in other.items()} | {hash(DTCompileConfig())}) == 5


def _context(**options):
    config = DTCompileConfig(**options)
    return pass_context(config, "forward")


def _graph():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.sin.default, (x,)))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_run_passes_checks_that_a_pass_returns_a_graph_module():
    broken = GraphPass(PassSpec("broken", Stage.DESCRIPTION), lambda gm, inputs, ctx: None)
    with pytest.raises(TypeError, match="dtcompile: pass broken returned NoneType, not the fx.GraphModule every pass must return"):
        run_passes(_graph(), [], _context(), passes=[broken])


def test_run_passes_times_each_pass_and_traces_its_graphs(monkeypatch):
    traced = []
    monkeypatch.setattr(
        "torch._logging.trace_structured",
        lambda kind, metadata_fn, payload_fn: traced.append((metadata_fn()["name"], payload_fn())),
    )
    identity = GraphPass(PassSpec("identity", Stage.DESCRIPTION), lambda gm, inputs, ctx: gm)
    _, records = run_passes(_graph(), [], _context(trace_pass_graphs=True), passes=[identity])
    assert records[0].ran and records[0].seconds >= 0
    forward = GraphKind.FORWARD
    assert [name for name, _ in traced] == [Artifact.pass_graph(forward, "before", "identity"), Artifact.pass_graph(forward, "after", "identity")]
    assert "torch.ops.aten.sin.default" in traced[0][1]
    traced.clear()
    run_passes(_graph(), [], _context(), passes=[identity])
    assert traced == []
