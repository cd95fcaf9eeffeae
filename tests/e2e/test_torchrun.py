"""``examples/train_torchrun.py`` launched with ``torchrun`` as a user launches a job.

On gloo over 127.0.0.1: one launch of two processes (``--standalone``), and two
launches of one process each that meet through c10d rendezvous
(``--nnodes=2``, as two machines would).  Each compiled run's losses equal
eager's; a run resumed from the distributed checkpoint saved mid-way equals
the run that was not stopped.  No launch logs c10d's store warnings
(``waitForInput ... likely a timeout``): the ranks' check waits for its peers
without them, however far apart the ranks compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.gloo]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_torchrun.py"
STEPS = 4
TIMEOUT_S = 300
C10D_WAIT_WARNING = "waitForInput"


def _torchrun(launch: list[str], *args: str) -> subprocess.Popen:
    # PYTHONFAULTHANDLER: a rank that aborts (the teardown abort of RESULTS' soak_flakes.py)
    # prints every thread's Python stack into the output a failure keeps.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launch, str(SCRIPT), "--steps", str(STEPS), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _finish(*procs: subprocess.Popen) -> list[str]:
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, out
        assert C10D_WAIT_WARNING not in out, out
        outs.append(out)
    return outs


def _standalone(*args: str) -> subprocess.Popen:
    return _torchrun(["--standalone", "--nproc-per-node=2"], *args)


def _losses(path: Path) -> dict[str, float]:
    return json.loads(path.read_text())


def _assert_close(got: dict[str, float], want: dict[str, float], what: str) -> None:
    assert got.keys() == want.keys(), (what, got, want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-5 * max(1.0, abs(loss)), f"{what}: step {step}: {got[step]} vs {loss}"


def test_torchrun_standalone_compiled_equals_eager_and_resumes_from_its_checkpoint(tmp_path):
    eager, compiled, resumed = tmp_path / "eager.json", tmp_path / "compiled.json", tmp_path / "resumed.json"
    checkpoint = tmp_path / "ckpt"
    (out_eager,) = _finish(_standalone("--eager", "--losses", str(eager)))
    (out,) = _finish(_standalone("--losses", str(compiled), "--checkpoint", str(checkpoint), "--save-at", "2"))
    (out_resumed,) = _finish(_standalone("--losses", str(resumed), "--checkpoint", str(checkpoint), "--resume"))
    assert "step 1 loss" in out and f"saved {checkpoint} after step 2" in out
    assert f"resumed from {checkpoint} after step 2" in out_resumed
    _assert_close(_losses(compiled), _losses(eager), "compiled vs eager")
    want_after = {k: v for k, v in _losses(compiled).items() if int(k) > 2}
    _assert_close(_losses(resumed), want_after, "resumed from step 2 vs not stopped")
    # The loss goes down: the optimizer trains.
    losses = _losses(eager)
    assert losses[str(STEPS)] < losses["1"], losses


def test_torchrun_two_nodes_on_loopback_equal_eager(tmp_path):
    import torch.distributed as dist

    eager, compiled = tmp_path / "eager.json", tmp_path / "compiled.json"
    # The rendezvous store, served by this process on a port the kernel picks and held until
    # the nodes end; neither node hosts it (is_host=false): a port picked free and bound by a
    # node seconds later can be taken in between by another test's ranks.
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)

    def node(rank: int, *args: str) -> subprocess.Popen:
        launch = [
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{store.port}",
            f"--rdzv-id=dtcompile-test-{store.port}",
            "--rdzv-conf=is_host=false",
        ]
        return _torchrun(launch, *args)

    _finish(_standalone("--eager", "--losses", str(eager)))
    # Node 1 writes no losses (rank 0 does); both must finish.
    _finish(node(0, "--losses", str(compiled)), node(1))
    _assert_close(_losses(compiled), _losses(eager), "two nodes compiled vs eager")
