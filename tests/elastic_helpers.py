"""Driving a real elastic trial (agent + workers, gloo on CPU slots) from a test or bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from training.checkpoint import load_model_weights
from training.config import TrialConfig
from training.agent_commands import write_command
from training.workload import build_model
from training.layout import trial_files


def cpu_slot(i: int) -> dict:
    return {"id": f"cpu{i}", "env": {"CAMPAIGN_CPU_CORES": str(i % os.cpu_count()), "CUDA_VISIBLE_DEVICES": ""}}


def trial_config(trial_dir: Path, digits: Path, **overrides) -> TrialConfig:
    # Two logical ranks: a run at 1 process and one at 2 train the same thing.
    base = dict(trial_id=trial_dir.name, seed=11, model={"name": "small_cnn", "width": 8, "dropout": 0.1},
                data={"path": str(digits)}, logical_ranks=2, steps=1500, batch_size=30, lr=0.05, warmup_steps=20,
                checkpoint_every=100, eval_every=1500, trial_dir=str(trial_dir), trace=True, control_every=5)
    return TrialConfig(**{**base, **overrides})


def cpu_slots(n: int) -> list[dict]:
    return [cpu_slot(i) for i in range(n)]


def start(cfg: TrialConfig, devices: int, slots=cpu_slots, prefix: tuple[str, ...] = (), env: dict | None = None,
          agent_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """The trial's agent on `slots(devices)`; `prefix`, `env`, `agent_args`: how it is started
    (a node's namespace, its address, `--node`)."""
    trial_dir = Path(cfg.trial_dir)
    (trial_dir / "control").mkdir(parents=True, exist_ok=True)
    (trial_dir / "trial.json").write_text(cfg.to_json())
    existing = sorted((trial_dir / "control").glob("command-*.json"))
    for old in existing:  # a relaunch starts a new command sequence, as the launcher does
        old.unlink()
    write_command(trial_dir / "control", 0, slots(devices))
    log = open(trial_dir / "agent.log", "ab")
    return subprocess.Popen([*prefix, sys.executable, "-m", "training.elastic", "--config", str(trial_dir / "trial.json"),
                             "--control", str(trial_dir / "control"), *agent_args], stdout=log, stderr=subprocess.STDOUT, env=env)


def step_of(cfg: TrialConfig) -> int:
    try:
        return json.loads(Path(cfg.progress_path).read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def wait_for_step(cfg: TrialConfig, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while step_of(cfg) < step:
        assert proc.poll() is None, f"trial ended early:\n{(Path(cfg.trial_dir) / 'agent.log').read_text()[-3000:]}"
        assert time.time() < deadline, f"step {step} not reached"
        time.sleep(0.005)


def resize(cfg: TrialConfig, seq: int, devices: int, mode: str = "resize", slots=cpu_slots) -> None:
    write_command(Path(cfg.trial_dir) / "control", seq, slots(devices), mode=mode)


def hold(cfg: TrialConfig) -> Path:
    """The trial's hold file, made before it starts: it waits at `cfg.hold_at_step` (and at
    each control step after it) while the file is there, unless its agent asks it to stop."""
    path = trial_files(cfg.trial_dir).hold
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def stop_requests(cfg: TrialConfig) -> int:
    """How many times the trial's agent has asked a generation to stop (its `stop-<gen>` files)."""
    return len(list((Path(cfg.trial_dir) / "control").glob("stop-*")))


def release_when_asked_to_stop(cfg: TrialConfig, proc: subprocess.Popen, before: int, timeout: float = 120) -> None:
    """Once the agent asks the held generation to stop (`before` counted before the command),
    remove the hold: the held trainer goes on to its stop step and the next generation runs
    free (a hold kept would stop it before its first step, which records the resize)."""
    deadline = time.time() + timeout
    while True:
        exited = proc.poll() is not None  # read before the files: an agent that exited has written its stop file
        if stop_requests(cfg) > before:
            break
        assert not exited, f"trial ended before its agent asked it to stop:\n{(Path(cfg.trial_dir) / 'agent.log').read_text()[-3000:]}"
        assert time.time() < deadline, "the agent never asked the trial to stop"
        time.sleep(0.01)
    trial_files(cfg.trial_dir).hold.unlink()


def run(cfg: TrialConfig, start_devices: int, plan: list[tuple[int, int]] = (), mode: str = "resize", slots=cpu_slots,
        **how) -> subprocess.Popen:
    """Start a trial and resize it to `devices` when it reaches `step`, for each (step, devices);
    each resize takes effect before the next is asked for.

    The trial is held before `cfg.hold_at_step` (if set) until a resize asked for there has
    reached its running processes (the agent asks them to stop: its joiners are ready). The
    joiners' start-up, seconds, then costs no steps, and a short trial still resizes long
    before its end, however slow the host."""
    held = hold(cfg) if cfg.hold_at_step is not None else None
    proc = start(cfg, start_devices, slots, **how)
    for seq, (step, devices) in enumerate(plan, 1):
        wait_for_step(cfg, step, proc)
        before = stop_requests(cfg)
        resize(cfg, seq, devices, mode, slots)
        if step == cfg.hold_at_step:
            release_when_asked_to_stop(cfg, proc, before)
        deadline = time.time() + 120
        while len(resizes(cfg)) < seq:
            assert proc.poll() is None, f"trial ended before resize {seq} took effect"
            assert time.time() < deadline, f"resize {seq} did not take effect"
            time.sleep(0.01)
    if held is not None:
        held.unlink(missing_ok=True)
    return proc


def finish(proc: subprocess.Popen, cfg: TrialConfig, timeout: float = 300) -> None:
    code = proc.wait(timeout=timeout)
    assert code == 0, f"agent exited {code}:\n{(Path(cfg.trial_dir) / 'agent.log').read_text()[-3000:]}"


def trace(cfg: TrialConfig) -> dict[int, tuple[list[int], float]]:
    """Per step: the global batch's sample ids in order, and its mean loss, from every process."""
    rows: dict[int, list[dict]] = {}
    for path in (Path(cfg.trial_dir) / "trace").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["step"], []).append(row)
    out = {}
    for step, parts in rows.items():
        parts.sort(key=lambda r: r["offset"])
        # A step re-run after a crash appears twice (same offsets): keep the last of each offset.
        by_offset = {r["offset"]: r for r in parts}
        ordered = [by_offset[o] for o in sorted(by_offset)]
        out[step] = ([s for r in ordered for s in r["samples"]], sum(r["loss_sum"] for r in ordered) / cfg.batch_size)
    return out


def final_weights(cfg: TrialConfig):
    result = json.loads(Path(cfg.result_path).read_text())
    return load_model_weights(Path(result["checkpoint"]), build_model(cfg.model)).state_dict()


def resizes(cfg: TrialConfig) -> list[dict]:
    path = Path(cfg.trial_dir) / "resizes.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
