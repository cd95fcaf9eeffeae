"""torchtitan's real trainer (``torchrun ... torchtitan.train``) with graph_trainer's default pipeline and dtcompile's.

The launch a user types, on 2 gloo ranks of this machine: graph_trainer's Llama3 debug
model (``graph_trainer_llama3_debugmodel_sdpa``: SimpleFSDP, the whole step traced as one
graph, graph_trainer's default memory policy and passes), its CLI, config registry,
dataloader and tokenizer, through the test-only CPU launcher
(``tests/clients/titan_trainer/cpu_launch.py``) and the assets it reads
(``tests/clients/titan_trainer/assets.py``).  dtcompile's pipeline is selected as its docs
say: ``--module dtcompile.integrations.graph_trainer.llama3 --compile.pass_pipeline
dtcompile``, dtcompile's defaults.  Both runs must give the same loss at every step (as
torchtitan prints them), and dtcompile's must have said where its pass stands and
bucketed the step graph's collectives (fewer after its pass than before).

The trainer needs torchtitan's own dependencies (torchdata, datasets, tokenizers,
tensorboard), which the client venv leaves out, so it runs in a venv of its own
(``tests/clients/trainer-requirements.txt``): ``DTCOMPILE_TITAN_PYTHON`` names that venv's
Python (the README's test command makes it); dtcompile is imported from this checkout.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "tests" / "clients" / "titan_trainer" / "cpu_launch.py"
ASSETS = ROOT / "tests" / "clients" / "titan_trainer" / "assets.py"
STEPS = 4

pytestmark = [pytest.mark.models, pytest.mark.subprocess]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LOSS = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")
_BUCKETING = re.compile(r"step: pass bucketing: nodes \d+ -> \d+, collectives (\d+) -> (\d+)")


@pytest.fixture(scope="module")
def titan_python() -> str:
    """The trainer venv's Python (``DTCOMPILE_TITAN_PYTHON``): fails in CI without it, skips elsewhere."""
    python = os.environ.get("DTCOMPILE_TITAN_PYTHON")
    if python and Path(python).exists():
        return python
    message = (
        "DTCOMPILE_TITAN_PYTHON must name the Python of a venv with torch, torchtitan and "
        "tests/clients/trainer-requirements.txt (the README's test command makes one)"
    )
    if os.environ.get("DTCOMPILE_TEST_INSTALLED") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def assets(titan_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("titan_assets")
    subprocess.run([titan_python, str(ASSETS), str(folder)], check=True, timeout=300)
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(titan_python: str, assets: Path, dump: Path, *flags: str) -> str:
    """The trainer's rank-0 output for ``STEPS`` steps with ``flags``; fails with its tail if it fails."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "HF_HOME": str(dump / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
    }
    env.pop("TORCH_TRACE", None)
    command = [
        titan_python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
        "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", str(LAUNCHER),
        "--config", "graph_trainer_llama3_debugmodel_sdpa",
        "--hf_assets_path", str(assets / "tokenizer"),
        "--dataloader.dataset", "c4_test", "--dataloader.dataset_path", str(assets / "c4_test"),
        "--dump_folder", str(dump), "--training.steps", str(STEPS),
        "--training.local_batch_size", "2", "--training.seq_len", "128",
        "--debug.seed", "42", "--debug.deterministic", *flags,
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = _ANSI.sub("", done.stdout + done.stderr)
    assert done.returncode == 0, f"the trainer failed (rc {done.returncode}):\n{out[-6000:]}"
    return out


def _losses(out: str) -> list[tuple[int, str]]:
    return [(int(step), loss) for step, loss in _LOSS.findall(out)]


def test_the_real_trainer_with_dtcompiles_pipeline_trains_as_graph_trainers_default(titan_python, assets, tmp_path):
    default = _train(titan_python, assets, tmp_path / "default", "--module", "graph_trainer.llama3")
    ours = _train(
        titan_python, assets, tmp_path / "dtcompile",
        "--module", "dtcompile.integrations.graph_trainer.llama3", "--compile.pass_pipeline", "dtcompile",
    )
    assert [step for step, _ in _losses(default)] == list(range(1, STEPS + 1)), default[-3000:]
    assert _losses(ours) == _losses(default)
    # graph_trainer's memory policy ran (its remat pass is in both pipelines), and dtcompile's
    # pass stood in the place of graph_trainer's bucketing, which it replaced.
    assert "selective_activation_remat_pass" in default and "selective_activation_remat_pass" in ours
    assert "dtcompile: graph_trainer pipeline 'dtcompile': dtcompile_step_pass at pass" in ours, ours[-3000:]
    assert "in place of joint_transformer_block_bucketing_reordering_pass" in ours
    assert "dtcompile_step_pass" not in default
    ((before, after),) = [(int(b), int(a)) for b, a in _BUCKETING.findall(ours)]
    assert after < before, (before, after)


