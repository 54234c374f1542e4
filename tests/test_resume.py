"""A 2-process torchrun trial killed with SIGKILL mid-training resumes to the same weights.

Also: a checkpoint whose files do not match its manifest is never loaded (the trial falls
back to the previous whole one), and a finished trial is not recomputed.
"""

from __future__ import annotations

import pytest

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from training.checkpoint import load_model_weights
from training.files import read_json
from training.layout import trial_files
from training.manifest import latest_valid_checkpoint, list_checkpoints
from training.config import TrialConfig
from training.workload import build_model

from conftest import wait_for

pytestmark = pytest.mark.slow  # real campaigns, torchrun or elastic trials: `make test-fast` skips them

STEPS, EVERY, HELD_AT = 600, 100, 350


def config(trial_dir: Path, data: Path) -> TrialConfig:
    return TrialConfig(
        trial_id="resume-test", seed=7, model={"name": "small_cnn", "width": 8, "dropout": 0.2},
        data={"path": str(data)}, logical_ranks=2, steps=STEPS, batch_size=32, lr=0.05, warmup_steps=10,
        checkpoint_every=EVERY, keep_checkpoints=3, eval_every=500, trial_dir=str(trial_dir),
    )


def launch(cfg: TrialConfig) -> subprocess.Popen:
    Path(cfg.trial_dir).mkdir(parents=True, exist_ok=True)
    path = Path(cfg.trial_dir) / "trial.json"
    path.write_text(cfg.to_json())
    cmd = [sys.executable, "-m", "training.launch", "--standalone", "--nproc-per-node=2", "-m", "training.train", "--config", str(path)]
    log = open(Path(cfg.trial_dir) / "train.log", "ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def workers_of(cfg: TrialConfig) -> list[int]:
    """Pids of processes running this trial's config (torchrun and its workers)."""
    needle = str(Path(cfg.trial_dir) / "trial.json").encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and needle in (proc / "cmdline").read_bytes() and b"Z" != (proc / "stat").read_bytes().split()[2]:
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def wait_until_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not workers_of_pids(pids):
            return True
        time.sleep(0.05)
    return False


def workers_of_pids(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_bytes().split()[2] != b"Z":
                alive.append(pid)
        except OSError:
            pass
    return alive


def final_weights(cfg: TrialConfig) -> dict[str, torch.Tensor]:
    result = json.loads(Path(cfg.result_path).read_text())
    model = build_model(cfg.model)
    return load_model_weights(Path(result["checkpoint"]), model).state_dict()


def run_to_end(cfg: TrialConfig) -> None:
    proc = launch(cfg)
    assert proc.wait(timeout=300) == 0, (Path(cfg.trial_dir) / "train.log").read_text()[-3000:]


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, digits_npz):
    straight = config(tmp_path / "straight", digits_npz)
    run_to_end(straight)

    # Held before step 350 while its `hold` file is there, three checkpoints written (100,
    # 200, 300): the kill lands mid-trial however loaded the machine.
    killed = replace(config(tmp_path / "killed", digits_npz), hold_at_step=HELD_AT)
    Path(killed.trial_dir).mkdir(parents=True)
    trial_files(killed.trial_dir).hold.touch()
    proc = launch(killed)
    wait_for(lambda: (read_json(trial_files(killed.trial_dir).progress) or {}).get("state") == "held" or proc.poll() is not None,
             120, "the trial to be held at step 350")
    assert proc.poll() is None, "trial ended before it could be killed"
    assert len(list_checkpoints(killed.checkpoint_dir)) == 3
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun; its workers must die with it
    proc.wait()
    assert wait_until_gone(workers_of(killed)), "workers outlived torchrun"
    assert not Path(killed.result_path).exists(), "the kill came too late: the trial had finished"
    steps_done = [int(p.name.split("-")[1]) for p in list_checkpoints(killed.checkpoint_dir)]
    assert max(steps_done) < STEPS

    # Corrupt the newest checkpoint: it must be detected and the one before used instead.
    newest = list_checkpoints(killed.checkpoint_dir)[0]
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-16] + b"\0" * 16)
    assert latest_valid_checkpoint(killed.checkpoint_dir) == list_checkpoints(killed.checkpoint_dir)[1]

    trial_files(killed.trial_dir).hold.unlink()
    run_to_end(killed)
    log = (Path(killed.trial_dir) / "train.log").read_text()
    assert f"resumed at step {max(steps_done) - EVERY}" in log
    a, b = final_weights(straight), final_weights(killed)
    assert a.keys() == b.keys()
    for name in a:
        # Same seed, same data order, same RNG per step: bit-for-bit on CPU.
        assert torch.equal(a[name], b[name]), f"{name} differs by {(a[name] - b[name]).abs().max()}"


def test_finished_trial_is_not_recomputed(tmp_path, digits_npz):
    cfg = replace(config(tmp_path / "short", digits_npz), steps=30, checkpoint_every=10, eval_every=10)
    run_to_end(cfg)
    first = Path(cfg.result_path).read_text()
    run_to_end(cfg)
    assert Path(cfg.result_path).read_text() == first
    assert "already finished, nothing to do" in (Path(cfg.trial_dir) / "train.log").read_text()

    # Killed after the final checkpoint but before the result: resume writes the result
    # from the final checkpoint without training a step.
    Path(cfg.result_path).unlink()
    run_to_end(cfg)
    result = json.loads(Path(cfg.result_path).read_text())
    assert result["resumed_from_step"] == 30 and result["steps"] == 30
    assert result["metrics"]["val_accuracy"] == json.loads(first)["metrics"]["val_accuracy"]
