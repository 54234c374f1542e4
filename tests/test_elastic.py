"""Elastic trials for real (agent + workers, gloo on CPU): resizes keep the result.

Tolerance: the trials have two logical ranks (tests/elastic_helpers.py), so one process
accumulates the two shards' gradients where two processes all-reduce them. Two terms add
alike in either order and the loss scales differ by a power of two, so in practice the
runs agree bit for bit; the bound is still relative to a control (a resized run may differ
from the fixed 2-process run by no more than a fixed 1-process run does, x10, + 1e-5),
because fast reduction promises only float rounding (with more logical ranks the order of
additions does change: tests/test_workload.py checks exact reduction there). The samples
of every step must be identical.
"""

from __future__ import annotations

import pytest

import os
import signal
import time
from pathlib import Path

from elastic_helpers import finish, final_weights, hold, resizes, run, start, step_of, trace, trial_config, wait_for_step, resize

pytestmark = pytest.mark.slow  # real campaigns, torchrun or elastic trials: `make test-fast` skips them

WEIGHT_ATOL, LOSS_ATOL = 1e-4, 1e-5


def differences(a, b) -> tuple[float, float]:
    """Largest loss difference over all steps and largest final weight difference; the samples
    of every step must be the same."""
    ta, tb = trace(a), trace(b)
    assert sorted(ta) == sorted(tb) == list(range(a.steps))
    for step in ta:
        assert ta[step][0] == tb[step][0], f"step {step}: different samples"
    wa, wb = final_weights(a), final_weights(b)
    return (max(abs(ta[s][1] - tb[s][1]) for s in ta), max((wa[n] - wb[n]).abs().max().item() for n in wa))


def assert_same_training(a, b, control=None):
    loss, weight = differences(a, b)
    if control is None:
        loss_bound, weight_bound = LOSS_ATOL, WEIGHT_ATOL
    else:
        control_loss, control_weight = differences(a, control)
        loss_bound, weight_bound = 10 * control_loss + 1e-5, 10 * control_weight + 1e-5
    assert loss <= loss_bound and weight <= weight_bound, (loss, weight, loss_bound, weight_bound)


def test_resize_2_1_2_trains_exactly_as_fixed_size(tmp_path, digits_npz):
    # Steps of ~10 ms; the trial is held at step 300 while the joiner starts (elastic_helpers.run),
    # so 500 steps are enough, and over 500 steps training has not amplified the rounding far above itself.
    heavy = dict(steps=500, batch_size=128, model={"name": "small_cnn", "width": 32, "dropout": 0.1})
    fixed = trial_config(tmp_path / "fixed", digits_npz, **heavy)
    finish(run(fixed, 2), fixed)
    control = trial_config(tmp_path / "fixed1", digits_npz, **heavy)
    finish(run(control, 1), control)
    elastic = trial_config(tmp_path / "elastic", digits_npz, **heavy, hold_at_step=300)
    finish(run(elastic, 2, [(100, 1), (300, 2)]), elastic)

    events = resizes(elastic)
    assert [(e["from"], e["to"]) for e in events] == [(["cpu0", "cpu1"], ["cpu0"]), (["cpu0"], ["cpu0", "cpu1"])]
    for e in events:
        assert 0 < e["pause_s"] < e["latency_s"] + 1e-9
        assert e["step"] % fixed.control_every == 1  # stopped at a control step, first step after it
    assert_same_training(fixed, elastic, control)


def test_naive_restart_path_keeps_the_result_too(tmp_path, digits_npz):
    """The stop-checkpoint-relaunch path (kept to measure against) works and is exact too."""
    fixed = trial_config(tmp_path / "fixed", digits_npz, steps=400)
    finish(run(fixed, 2), fixed)
    restarted = trial_config(tmp_path / "restarted", digits_npz, steps=400, hold_at_step=200)
    finish(run(restarted, 2, [(200, 2)], mode="restart"), restarted)
    (event,) = resizes(restarted)
    assert event["mode"] == "restart" and event["pause_breakdown_s"]
    assert_same_training(fixed, restarted)  # same size throughout: only the restart in between


def test_micro_batches_keep_the_result(tmp_path, digits_npz):
    """Gradient accumulation (a per-process batch limit) changes nothing but the rounding."""
    whole = trial_config(tmp_path / "whole", digits_npz, steps=300)
    finish(run(whole, 1), whole)
    split = trial_config(tmp_path / "split", digits_npz, steps=300, max_device_batch=4)
    finish(run(split, 2), split)
    assert_same_training(whole, split)


def worker_pids(wid: str, config: Path) -> list[int]:
    """The trial's worker `wid`: forked from the agent's zygote, its command line is the
    zygote's (which names the trial's config) and its process name says which worker it is."""
    from training.elastic import worker_name

    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if str(config).encode() in (proc / "cmdline").read_bytes() and (proc / "comm").read_text().strip() == worker_name(wid):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_rank_killed_mid_resize_recovers_from_last_complete_state(tmp_path, digits_npz):
    fixed = trial_config(tmp_path / "fixed", digits_npz, steps=500)
    finish(run(fixed, 2), fixed)
    control = trial_config(tmp_path / "fixed1", digits_npz, steps=500)  # the trial runs 300 steps at 1 process
    finish(run(control, 1), control)

    # Held at step 300 while the joiner starts and the member is killed: the resize is under
    # way whatever the host's speed.
    trial = trial_config(tmp_path / "killed", digits_npz, steps=500, hold_at_step=300)
    config = Path(trial.trial_dir) / "trial.json"
    held = hold(trial)
    proc = start(trial, 1)
    wait_for_step(trial, 300, proc)
    resize(trial, 1, 2)  # a joiner starts: the resize is under way
    deadline = time.time() + 30
    while not worker_pids("w1", config):
        assert time.time() < deadline
        time.sleep(0.005)
    (victim,) = worker_pids("w0", config)  # the member that holds the state
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=60) == 1  # the agent ends the trial's other processes and fails
    # Killed with the agent (SIGKILL), they are gone once the kernel has reaped them; one that
    # outlived its trial would stay.
    deadline = time.time() + 30
    while worker_pids("w1", config):
        assert time.time() < deadline, "a worker outlived its failed trial"
        time.sleep(0.01)
    killed_at = step_of(trial)
    assert 300 <= killed_at < trial.steps

    held.unlink()
    finish(start(trial, 2), trial)  # what the launcher's retry does
    log = (Path(trial.trial_dir) / "agent.log").read_text()
    assert "killed by SIGKILL" in log  # the signal named, not "exited with code -9"
    assert_same_training(fixed, trial, control)


def test_preemption_saves_state_and_resumes_later(tmp_path, digits_npz):
    fixed = trial_config(tmp_path / "fixed", digits_npz, steps=600)
    finish(run(fixed, 1), fixed)
    control = trial_config(tmp_path / "fixed2", digits_npz, steps=600)  # the 2-process rounding, for the bound
    finish(run(control, 2), control)
    trial = trial_config(tmp_path / "preempted", digits_npz, steps=600)
    proc = start(trial, 2)
    wait_for_step(trial, 200, proc)
    from training.elastic import PREEMPTED
    from training.agent_commands import write_command

    write_command(Path(trial.trial_dir) / "control", 1, [])
    assert proc.wait(timeout=60) == PREEMPTED
    assert not Path(trial.result_path).exists()
    finish(start(trial, 1), trial)  # resumed later, on another number of devices
    assert_same_training(fixed, trial, control)


def test_a_shrink_is_reported_applied_only_once_the_dropped_worker_has_exited(tmp_path, digits_npz):
    """The campaign gives a dropped device back when the agent's state says the shrink is
    applied: the worker that trained on it must be gone by then (it still holds its memory
    there, a data set on a GPU included), not exiting a few hundred milliseconds later."""
    from conftest import wait_for
    from training.agent_state import read_agent_state

    trial = trial_config(tmp_path / "shrunk", digits_npz, steps=400, checkpoint_every=1000, eval_every=1000)
    proc = start(trial, 2)
    config = Path(trial.trial_dir) / "trial.json"
    try:
        wait_for_step(trial, 20, proc)
        assert worker_pids("w1", config)
        resize(trial, 1, 1)
        control = Path(trial.trial_dir) / "control"

        def applied():
            assert proc.poll() is None, "the trial ended before its shrink was applied"
            state = read_agent_state(control)
            return state if state is not None and state.seq == 1 and state.status == "running" else None

        state = wait_for(applied, 120, "the shrink applied", every=0.001)
        assert list(state.devices) == ["cpu0"] and worker_pids("w1", config) == []
        finish(proc, trial)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
