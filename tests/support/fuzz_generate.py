"""Drawing programs with hypothesis, each step checked on simulated ranks as it is drawn.

:func:`program_strategy` is a hypothesis strategy for one :class:`Program` on a
mesh: its inputs, then up to ``max_steps`` steps drawn from the families of
:mod:`fuzz_steps`.  Every step is executed at once on ``LocalTensorMode`` (all
ranks in one process, real collective semantics), which tells the next steps
the placements and per-rank shapes they work with.  A step that raises there is
dropped, or, now and then, kept as the program's last step: such a program
tests that compiled code refuses what eager refuses.  Only errors of DTensor
ops are kept (they are decided on global metadata, the same on every rank); a
plain local op that fails on some ranks only would leave the others waiting in
a collective.

:func:`generate_programs` draws a fixed number of programs per mesh from a
fixed seed: hypothesis's generate phase alone (no database, no shrinking),
collecting each drawn example, so the same seed gives the same programs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any
from unittest import mock

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from dtcompile.testing import simulated_world
from support.fuzz_programs import MESHES, Input, Program, Step, make_input, namespace
from support.fuzz_steps import BUILDERS, Gen, draw_placements

__all__ = ["execute_step", "generate_programs", "program_strategy"]

_FAMILIES = [family for family, (_, weight) in BUILDERS.items() for _ in range(weight)]


def execute_step(step: Step, env: dict[str, Any], ns: dict[str, Any]) -> Any:
    """Runs one step's line with the values in ``env`` (``mesh`` among them); returns its value."""
    if step.region:
        exec(compile(step.region_source(), f"<region_{step.out}>", "exec"), ns)
    code = step.line().split(" = ", 1)[1]
    return eval(code, ns, env)  # noqa: S307 - the fuzzer's own generated code


def _draw_shape(g: Gen, previous: list[tuple[int, ...]]) -> tuple[int, ...]:
    if previous and g.draw(st.booleans()):
        base = g.choice(previous)
        relation = g.choice(["same", "matmul", "vector", "linear"])
        if relation == "same":
            return base
        if relation == "matmul":
            return (base[-1], g.draw(st.integers(1, 6)))
        if relation == "linear":
            return (g.draw(st.integers(1, 6)), base[-1])
        return (base[-1],)
    ndim = g.draw(st.integers(1, 3))
    return tuple(g.draw(st.integers(1, 6)) for _ in range(ndim))


def _draw_inputs(g: Gen) -> list[Input]:
    inputs: list[Input] = []
    for i in range(g.draw(st.integers(1, 3))):
        shape = _draw_shape(g, [spec.shape for spec in inputs])
        placements = tuple(draw_placements(g, len(shape), partial=True, strided=True))
        spec = Input(f"x{i}", shape, placements, g.draw(st.booleans()), g.draw(st.integers(0, 9999)))
        try:
            value = make_input(spec, g.mesh, None)
        except Exception:  # noqa: BLE001 - a placement this shape cannot take: replicate it
            spec = Input(spec.name, shape, ("Replicate()",) * g.mesh.ndim, spec.requires_grad, spec.seed)
            value = make_input(spec, g.mesh, None)
        g.env[spec.name] = value
        inputs.append(spec)
    return inputs


def _well_formed(value: Any) -> bool:
    """A tensor whose global shape is the same on every rank (a DTensor built from
    uneven shards without ``shape=`` has a per-rank one: a user error, not a program)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor):
        return False
    return not isinstance(value, DTensor) or all(type(s) is int for s in value.shape)


def _is_uniform(g: Gen, draft: Any) -> bool:
    if draft.uniform is not None:
        return draft.uniform
    return all(g.is_dtensor(a) or g.uniform.get(a, False) for a in draft.args)


def _draw_loss(g: Gen, outputs: tuple[str, ...], ns: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    terms = []
    for name in outputs:
        value = g.env[name]
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            continue
        how = g.choice(["to_local", "full_tensor"]) if g.is_dtensor(name) else "sum"
        terms.append((name, how))
    if not terms:
        return ()
    code = " + ".join(
        {"to_local": f"{n}.to_local().sum()", "full_tensor": f"{n}.full_tensor().sum()", "sum": f"{n}.sum()"}[h]
        for n, h in terms
    )
    try:
        eval(code, ns, g.env).backward()  # noqa: S307
    except Exception:  # noqa: BLE001 - no backward for this program
        return ()
    return tuple(terms)


@st.composite
def program_strategy(draw: Any, mesh_kind: str, mesh: Any, max_steps: int = 6) -> Program:
    """One program on ``mesh`` (of kind ``mesh_kind``), drawn while a simulated world is open."""
    g = Gen(draw, mesh)
    g.env["mesh"] = mesh
    ns = namespace()
    inputs = _draw_inputs(g)
    del g.env["mesh"]
    steps: list[Step] = []
    expect_raise = False
    num_steps = draw(st.integers(1, max_steps))
    for _ in range(num_steps * 4):
        if len(steps) == num_steps:
            break
        builders, _ = BUILDERS[g.choice(_FAMILIES)]
        draft = g.choice(list(builders))(g)
        if draft is None:
            continue
        step = Step(draft.kind, draft.op, f"t{len(steps)}", draft.args, draft.code, draft.region, draft.rng)
        # Random factories do not run on simulated ranks; their value's shape and
        # placements are those of the same factory of ones.
        probe = step if not step.rng else Step(step.kind, step.op, step.out, step.args, step.code.replace("dtensor.randn(", "dtensor.ones("))
        try:
            value = execute_step(probe, {**g.env, "mesh": mesh}, ns)
        except Exception:  # noqa: BLE001 - eager refuses this step
            # DTensor ops decide on global metadata, the same on every rank; keep a few.
            if (not step.args or any(g.is_dtensor(a) for a in step.args)) and g.chance(5):
                steps.append(step)
                expect_raise = True
                break
            continue
        if not _well_formed(value):
            continue
        g.uniform[step.out] = _is_uniform(g, draft)
        g.env[step.out] = value
        steps.append(step)
    if not steps:
        step = Step("elementwise", "relu", "t0", (inputs[0].name,), "torch.relu({0})")
        g.env["t0"] = execute_step(step, {**g.env, "mesh": mesh}, ns)
        steps.append(step)
    used = {a for s in steps for a in s.args}
    outputs = tuple(s.out for s in steps if s.out not in used)
    loss: tuple[tuple[str, str], ...] = ()
    if not expect_raise and any(i.requires_grad for i in inputs) and draw(st.booleans()):
        loss = _draw_loss(g, outputs, {**ns, "mesh": mesh})
    return Program(mesh_kind, tuple(inputs), tuple(steps), outputs, loss, expect_raise)


@contextlib.contextmanager
def _no_source_constants() -> Iterator[None]:
    """Hypothesis without the constants it harvests from the source of loaded modules.

    Now and then hypothesis draws a literal found in any local module loaded
    (``hypothesis.internal.conjecture.providers``): which modules a pytest session
    has loaded, and every edit to them, would change the programs a seed draws.
    """
    from hypothesis.internal.conjecture.providers import HypothesisProvider

    with mock.patch.object(HypothesisProvider, "_maybe_draw_constant", lambda self, *args, **kwargs: None):
        yield


def _collect(mesh_kind: str, mesh: Any, count: int, seed: int) -> list[Program]:
    drawn: list[Program] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=count,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @given(program_strategy(mesh_kind, mesh))
    def collect(program: Program) -> None:
        drawn.append(program)

    with _no_source_constants():
        collect()
    return drawn


def generate_programs(counts: Mapping[str, int], seed: int) -> list[Program]:
    """``counts[mesh_kind]`` distinct programs per mesh kind, the same ones for the same seed."""
    programs: list[Program] = []
    for k, (mesh_kind, count) in enumerate(counts.items()):
        world_size, shape, names = MESHES[mesh_kind]
        kept: dict[Program, None] = {}
        with simulated_world(world_size, shape, names) as mesh:
            for attempt in range(10):
                if len(kept) >= count:
                    break
                # Hypothesis starts each run with its simplest example, and mutates the ones it
                # drew: ask for more than missing, keep the first distinct ones.
                missing = count - len(kept)
                for program in _collect(mesh_kind, mesh, missing + missing // 10 + 5, seed * 1000 + k * 100 + attempt):
                    kept.setdefault(program)
        programs += list(kept)[:count]
    return programs
