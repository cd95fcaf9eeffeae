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

STEPS = 4

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
