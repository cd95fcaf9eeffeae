"""torchtitan's real trainer (``torchrun ... torchtitan.train``) with graph_trainer's default pipeline and dtcompile's.

The launch a user types, on 2 gloo ranks of this machine (:mod:`support.titan_trainer`):
graph_trainer's Llama3 debug model (``graph_trainer_llama3_debugmodel_sdpa``: SimpleFSDP,
the whole step traced as one graph, graph_trainer's default memory policy and passes), its
CLI, config registry, dataloader and tokenizer, through the test-only CPU launcher.
dtcompile's pipeline is selected as its docs say: ``--module
dtcompile.integrations.graph_trainer.llama3 --compile.pass_pipeline dtcompile``, dtcompile's
defaults.  Both runs must give the same loss at every step (as torchtitan prints them), and
dtcompile's must have said where its pass stands and bucketed the step graph's collectives
(fewer after its pass than before).

graph_trainer's memory policy runs before dtcompile's pass and its other passes after it
(regional Inductor, kernel annotations, CUDA graphs): under each policy (the default, ``full``
recompute, ``sac_and_offload``) the two pipelines list the same passes but the one replaced,
tag the same activations, and leave the same recomputed nodes and offload ops in the step graph
after every pass has run; ``full`` trains to the same losses.  ``sac_and_offload`` cannot run a
step on CPU (torch's ``ao.offload`` asks the accelerator for a stream), on either pipeline: the
test holds both to that same failure, after all their passes ran.

The trainer needs torchtitan's own dependencies (torchdata, datasets, tokenizers,
tensorboard), which the client venv leaves out, so it runs in a venv of its own
(``tests/clients/trainer-requirements.txt``): ``DTCOMPILE_TITAN_PYTHON`` names that venv's
Python (the README's test command makes it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.titan_trainer import DEFAULT, DTCOMPILE, make_assets, train

STEPS = 10
POLICY_STEPS = 3

pytestmark = [pytest.mark.models, pytest.mark.subprocess]


@pytest.fixture(scope="module")
def titan_python() -> str:
    """The trainer venv's Python (``DTCOMPILE_TITAN_PYTHON``): fails in CI without it, skips elsewhere."""
    python = os.environ.get("DTCOMPILE_TITAN_PYTHON")
    if python and Path(python).exists():
        return python
    message = (
        "DTCOMPILE_TITAN_PYTHON must name the Python of a venv with tests/clients/trainer-requirements.txt "
        "(the README's test command makes one)"
    )
    if os.environ.get("DTCOMPILE_TEST_INSTALLED") == "1":
        pytest.fail(message)
    pytest.skip(message)


def test_the_real_trainer_with_dtcompiles_pipeline_trains_as_graph_trainers_default(titan_python, tmp_path):
    assets = make_assets(titan_python, tmp_path / "assets")
    default = train(titan_python, assets, tmp_path / "default", DEFAULT, steps=STEPS)
    ours = train(titan_python, assets, tmp_path / "dtcompile", DTCOMPILE, steps=STEPS)
    assert [step for step, _ in default.losses] == list(range(1, STEPS + 1)), default.out[-3000:]
    assert ours.losses == default.losses
    # graph_trainer's memory policy ran (its remat pass is in both pipelines), and dtcompile's
    # pass stood in the place of graph_trainer's bucketing, which it replaced.
    assert "selective_activation_remat_pass" in default.out and "selective_activation_remat_pass" in ours.out
    assert "dtcompile: graph_trainer pipeline 'dtcompile': dtcompile_step_pass at pass" in ours.out, ours.out[-3000:]
    assert "in place of joint_transformer_block_bucketing_reordering_pass" in ours.out
    assert "dtcompile_step_pass" not in default.out and default.bucketed is None
    before, after = ours.bucketed
    assert after < before, (before, after)


REPLACED = "joint_transformer_block_bucketing_reordering_pass"
OFFLOAD_ON_CPU = "cpu doesn't match the current accelerator"
"""torch's ``ao.offload`` on a CPU-only machine (``torch.accelerator.current_stream``)."""


@pytest.mark.parametrize("policy", ["full", "sac_and_offload"])
def test_graph_trainers_passes_run_after_dtcompiles_under_each_memory_policy(policy, titan_python, tmp_path):
    assets = make_assets(titan_python, tmp_path / "assets")
    flags = ("--compile.memory_policy", policy)
    runs = {
        name: train(titan_python, assets, tmp_path / name, (*pipeline, *flags), steps=POLICY_STEPS, measure=True,
                    check=policy != "sac_and_offload")
        for name, pipeline in (("default", DEFAULT), ("dtcompile", DTCOMPILE))
    }
    default, ours = runs["default"], runs["dtcompile"]
    # The same passes in the same order, dtcompile's in the place of graph_trainer's bucketing:
    # its memory policy, offload and remat before, regional Inductor and the rest after.
    assert REPLACED in default.pipeline and "dtcompile_step_pass" not in default.pipeline, default.pipeline
    assert ours.pipeline == [("dtcompile_step_pass" if p == REPLACED else p) for p in default.pipeline], ours.pipeline
    position = ours.pipeline.index("dtcompile_step_pass")
    assert {"tag_with_memory_policy_pass", "apply_cpu_offload_pass", "selective_activation_remat_pass"} <= set(
        ours.pipeline[:position]), ours.pipeline
    assert "regional_inductor_pass" in ours.pipeline[position + 1:], ours.pipeline
    # The policy tagged the same activations, and what it made of them is in the step graph after
    # every pass, dtcompile's included: the recomputed nodes, the offloads with their reloads.
    assert default.memory_policy and ours.memory_policy == default.memory_policy, (ours.memory_policy, default.memory_policy)
    for what in ("recomputed nodes", "ao.offload", "ao.reload", "ao.wait_tensor"):
        assert ours.measured(what) == default.measured(what), (what, ours.measured(what), default.measured(what))
        assert sorted(ours.measured(what)) == [0, 1], (what, ours.out[-3000:])
    before, after = ours.bucketed
    assert after < before, (before, after)
    assert ours.measured("collectives")[0] == after
    if policy == "full":
        # Everything but the layers' outputs recomputed in the backward; trained alike.
        assert all(recompute > save for save, recompute in ours.memory_policy.values()), ours.memory_policy
        assert ours.measured("recomputed nodes")[0] > 0 and ours.measured("ao.offload")[0] == 0
        assert [step for step, _ in ours.losses] == list(range(1, POLICY_STEPS + 1)), ours.out[-3000:]
        assert ours.losses == default.losses
    else:
        offloads = ours.measured("ao.offload")[0]
        assert offloads > 0 and ours.measured("ao.reload")[0] == offloads, ours.out[-3000:]
        assert ours.measured("ao.wait_tensor")[0] == 2 * offloads
        # Both stop at the first step's first offload, after all their passes ran: not dtcompile's doing.
        for run in (default, ours):
            assert run.returncode != 0 and OFFLOAD_ON_CPU in run.out and "graph passes took" in run.out, run.out[-3000:]
            assert not run.losses
