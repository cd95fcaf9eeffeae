"""torchtitan's real trainer on this machine: the launch and what its log says.

One ``torchrun`` of ``torchtitan.train`` through the test-only CPU launcher
(``tests/clients/titan_trainer/cpu_launch.py``) on 2 gloo ranks, graph_trainer's Llama3
debug model, the assets ``tests/clients/titan_trainer/assets.py`` makes; used by
``tests/clients/test_titan_trainer.py`` and ``benchmarks/titan_trainer.py``.  The trainer
runs in a venv of its own (``tests/clients/trainer-requirements.txt``); dtcompile is
imported from this checkout.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "tests" / "clients" / "titan_trainer" / "cpu_launch.py"
ASSETS = ROOT / "tests" / "clients" / "titan_trainer" / "assets.py"
CONFIG = "graph_trainer_llama3_debugmodel_sdpa"

DEFAULT = ("--module", "graph_trainer.llama3")
"""graph_trainer's own Llama3 configs and its default pass pipeline."""
DTCOMPILE = ("--module", "dtcompile.integrations.graph_trainer.llama3", "--compile.pass_pipeline", "dtcompile")
"""The same configs with dtcompile's pipeline, selected as its docs say."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"(\d\d:\d\d:\d\d,\d\d\d) - root - INFO - step:\s+(\d+)\s+loss:\s+([0-9.]+)")
_PASSES = re.compile(r"All \d+ graph passes took ([0-9.]+)s")
_BUCKETING = re.compile(r"step: pass bucketing: nodes \d+ -> \d+, collectives (\d+) -> (\d+)")
_MEASURED = re.compile(r"\[cpu_launch\] rank (\d+) ([A-Za-z_. ]+?)(?: after the passes)?: (\d+)")
_PIPELINE = re.compile(r"Applying \d+ graph passes:\n((?:\[rank0\]:\s+\d+\. \w+\n)+)")
_POLICY = re.compile(r"- root - INFO -\s+Layer ([\w-]+): (\d+) MUST_SAVE, (\d+) RECOMPUTE")


def make_assets(python: str, folder: Path) -> Path:
    subprocess.run([python, str(ASSETS), str(folder)], check=True, timeout=300)
    return folder


@dataclass
class TrainerRun:
    """What one launch printed (every rank's lines when ``measure``, else rank 0's)."""

    out: str
    seconds: float
    returncode: int = 0

    @property
    def losses(self) -> list[tuple[int, str]]:
        """``(step, loss)`` as torchtitan prints them (5 decimals), rank 0's."""
        return [(int(step), loss) for _, step, loss in _STEP.findall(self._rank0)]

    @property
    def _rank0(self) -> str:
        lines = [line for line in self.out.splitlines() if not line.startswith("[rank1]")]
        return "\n".join(lines)

    @property
    def steps_per_s(self) -> float:
        """Steps after the first (which traces and compiles), by the log's timestamps."""
        stamps = [_seconds(stamp) for stamp, _, _ in _STEP.findall(self._rank0)]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else 0.0

    @property
    def passes_s(self) -> float | None:
        found = _PASSES.findall(self._rank0)
        return float(found[0]) if found else None

    @property
    def bucketed(self) -> tuple[int, int] | None:
        """dtcompile's bucketing pass: the step graph's collectives before and after it."""
        found = _BUCKETING.findall(self._rank0)
        return (int(found[0][0]), int(found[0][1])) if found else None

    @property
    def pipeline(self) -> list[str]:
        """The graph passes graph_trainer applied, in order, as it lists them."""
        found = _PIPELINE.search(self._rank0 + "\n")
        return re.findall(r"\d+\. (\w+)", found.group(1)) if found else []

    @property
    def memory_policy(self) -> dict[str, tuple[int, int]]:
        """Per layer (``"0"``, ..., ``"non-layer"``): the memory policy's MUST_SAVE and RECOMPUTE tags."""
        return {layer: (int(save), int(recompute)) for layer, save, recompute in _POLICY.findall(self._rank0)}

    def measured(self, what: str) -> dict[int, int]:
        """Per rank, with ``measure``: ``collectives``, ``recomputed nodes``, ``ao.offload``,
        ``ao.reload``, ``ao.wait_tensor`` (in the step graph after the passes) or ``peak RSS`` (MiB)."""
        return {int(rank): int(value) for rank, name, value in _MEASURED.findall(self.out) if name == what}


def _seconds(stamp: str) -> float:
    hours, minutes, rest = stamp.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(rest.replace(",", "."))


def train(
    python: str, assets: Path, dump: Path, flags: tuple[str, ...], *, steps: int, measure: bool = False, check: bool = True
) -> TrainerRun:
    """One launch for ``steps`` steps (seed 42, deterministic); raises with the log's tail if it
    fails, unless ``check`` is false (the run's ``returncode`` says)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "HF_HOME": str(dump / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
    }
    env.pop("TORCH_TRACE", None)
    if measure:
        env["TITAN_CPU_LAUNCH_MEASURE"] = "1"
    command = [
        python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        *(() if measure else ("--local-ranks-filter", "0")), "--role", "rank", "--tee", "3", str(LAUNCHER),
        "--config", CONFIG, "--hf_assets_path", str(assets / "tokenizer"),
        "--dataloader.dataset", "c4_test", "--dataloader.dataset_path", str(assets / "c4_test"),
        "--dump_folder", str(dump), "--training.steps", str(steps),
        "--training.local_batch_size", "2", "--training.seq_len", "128",
        "--debug.seed", "42", "--debug.deterministic", *flags,
    ]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = _ANSI.sub("", done.stdout + done.stderr)
    if check and done.returncode != 0:
        raise AssertionError(f"the trainer failed (rc {done.returncode}):\n{out[-6000:]}")
    return TrainerRun(out, time.perf_counter() - start, done.returncode)
