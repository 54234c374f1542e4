"""The watchdog for stalled trials (tasks/watchdog.py, `training.stall_timeout_s`): the rule on
a fake clock, the stack dump and stop on real processes, and a campaign whose first trial
hangs while the one queued behind it on the same device still runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tasks.watchdog import (AUTO, FLOOR_S, Seen, Stall, StallClock, Watchdog, catches, default_limit_s, dump_stacks, queued_again, seen_in,
                            seen_since)
from training.progress import Progress, progress_now
from training.spec import SpecError, parse_spec

from conftest import wait_for


def running(step: int, step_time_s: float | None = None, updated: float | None = None) -> Seen:
    """As the project's loop writes it: a new write when the step has moved."""
    return Seen("running", step, step_time_s, float(step) if updated is None else updated)


# --- the rule, on a fake clock -------------------------------------------------------------


def test_a_step_that_stands_still_past_the_timeout_is_a_stall():
    clock = StallClock(10.0, launched_at=0.0)
    for t in range(0, 20, 2):  # a step every 2 s: never 10 s without one
        assert clock.observe(running(t // 2), float(t)) is None
    assert clock.observe(running(9), 28.0) is None  # 10 s since step 9 came (at 18 s): not yet past
    stall = clock.observe(running(9), 28.5)
    assert stall is not None and stall.reason == "stalled at step 9 for 10 s" and not stall.silent


def test_nothing_since_the_launch_is_a_stall_counted_from_the_launch():
    clock = StallClock(10.0, launched_at=100.0)
    assert clock.observe(Seen(None, 0), 109.0) is None
    stall = clock.observe(Seen(None, 40), 111.0)  # an earlier segment's step: where it resumes
    assert stall.silent and stall.reason == "stalled at step 40 for 11 s (no progress since its launch)"
    # The first write after the launch is progress: the clock starts again from it.
    clock = StallClock(10.0, launched_at=100.0)
    assert clock.observe(running(40), 109.0) is None and clock.observe(running(40), 118.0) is None
    assert clock.observe(running(40), 119.5) is not None


def test_a_progress_file_from_before_the_launch_counts_as_none():
    earlier = progress_now("held", 12, 100, 1, 8, {"step_time_s": 0.5})
    assert seen_in(earlier, launched_at=earlier.updated + 1) == Seen(None, 12)
    assert seen_in(earlier, launched_at=earlier.updated - 1) == Seen("held", 12, 0.5, earlier.updated)
    assert seen_in(None, launched_at=0.0) == Seen(None, 0)


def test_a_function_trial_is_alive_while_it_reports_and_stalled_once_it_stops():
    """ctx.report writes the progress file (at most once a second): a report is progress even
    at a step it reported before; no report for the timeout is a stall."""
    clock = StallClock(10.0, launched_at=0.0)
    for t in range(1, 60, 5):
        assert clock.observe(Seen("running", 7, None, updated=float(t)), float(t)) is None
    assert clock.observe(Seen("running", 7, None, updated=56.0), 66.0) is None
    assert clock.observe(Seen("running", 7, None, updated=56.0), 66.5).reason == "stalled at step 7 for 10 s"


def test_a_finished_trial_whose_processes_outlive_the_limit_is_stopped_as_finished():
    """Its result is written; a teardown that hangs (an exit hook joining a helper, a process
    group never destroyed) would hold its devices for good: past the limit it is stopped, and
    the stall says it had finished (run_plan records it finished from its result)."""
    clock = StallClock(10.0, launched_at=0.0)
    assert clock.observe(running(30), 1.0) is None
    assert clock.observe(Seen("finished", 30, None, updated=2.0), 2.0) is None
    assert clock.observe(Seen("finished", 30, None, updated=2.0), 12.0) is None
    stall = clock.observe(Seen("finished", 30, None, updated=2.0), 12.5)
    assert stall.finished and stall.reason == "finished at step 30, but its processes were still there 10 s later"


def test_a_test_hold_is_never_a_stall():
    clock = StallClock(10.0, launched_at=0.0)
    assert clock.observe(running(3), 1.0) is None
    assert clock.observe(Seen("held", 3), 2.0) is None
    assert clock.observe(Seen("held", 3), 10_000.0) is None
    # Running again (the hold released): the clock starts at the change.
    assert clock.observe(running(3), 10_001.0) is None
    assert clock.observe(running(3), 10_010.0) is None
    assert clock.observe(running(3), 10_011.5).reason == "stalled at step 3 for 10 s"


@pytest.mark.parametrize("timeout_s, limit_s", [(10.0, FLOOR_S), (AUTO, FLOOR_S), (900.0, 900.0)])
def test_a_resize_whose_next_generation_never_trains_is_a_stall_after_at_least_the_floor(timeout_s, limit_s):
    """Between two generations (new workers starting, a rendezvous, the state sent or loaded)
    the progress file says `resizing`: a hang there would hold the trial's devices for good.
    It is a stall past the limit, never sooner than FLOOR_S (new processes start afresh)."""
    clock = StallClock(timeout_s, launched_at=0.0)
    assert clock.observe(running(3), 1.0) is None
    assert clock.observe(Seen("resizing", 3, None, updated=2.0), 2.0) is None
    assert clock.observe(Seen("resizing", 3, None, updated=2.0), 2.0 + limit_s) is None
    stall = clock.observe(Seen("resizing", 3, None, updated=2.0), 3.0 + limit_s)
    assert stall.resizing and not stall.silent
    assert stall.reason == f"stalled in a resize at step 3 for {limit_s + 1:.0f} s (its next generation never trained a step)"
    # The next generation writes "running" as it starts, then sets up (a function trial's
    # whole setup is there): the floor holds until it steps past where the resize stopped...
    resized = StallClock(timeout_s, launched_at=0.0)
    resized.observe(Seen("resizing", 3, None, updated=2.0), 2.0)
    assert resized.observe(Seen("running", 3, None, updated=250.0), 250.0) is None
    assert resized.observe(Seen("running", 3, None, updated=250.0), 250.0 + limit_s) is None
    late = resized.observe(Seen("running", 3, None, updated=250.0), 251.0 + limit_s)
    assert late.resizing and late.reason.startswith("stalled in a resize at step 3")
    # ...then the step's own limit again.
    resized = StallClock(timeout_s, launched_at=0.0)
    resized.observe(Seen("resizing", 3, None, updated=2.0), 2.0)
    assert resized.observe(Seen("running", 4, None, updated=250.0), 250.0) is None
    stall = resized.observe(Seen("running", 4, None, updated=250.0), 250.0 + resized.limit_s() + 1)
    assert not stall.resizing and stall.reason.startswith("stalled at step 4")


def test_a_resize_that_hung_is_queued_again_once_and_any_other_stall_is_final():
    """The rule a trial's segment on one machine and the campaign over several nodes both
    follow: a resize that hung resumes from its checkpoint, but not twice in a row."""
    in_resize, at_step = Stall(3, 400.0, silent=False, resizing=True), Stall(3, 400.0, silent=False)
    assert queued_again(in_resize, None) and queued_again(in_resize, "stalled at step 2 for 90 s")
    assert not queued_again(in_resize, in_resize.reason)  # the run before hung in a resize too
    assert not queued_again(at_step, None) and not queued_again(Stall(3, 400.0, silent=False, finished=True), None)


def test_an_evaluation_writes_progress_as_it_goes(tmp_path, digits_npz, monkeypatch):
    """A first evaluation longer than the limit must not read as a stall: nothing before it
    told `auto` to expect one. Rank 0 writes its progress as the validation batches go by
    (at most every PROGRESS_EVERY_S; here at each batch), at the step it evaluates."""
    import torch
    import torch.distributed as dist

    import training.trainer as trainer_module
    from training.config import TrialConfig
    from training.progress import read_progress

    cfg = TrialConfig(trial_id="e", seed=0, model={"name": "mlp", "width": 8}, data={"path": str(digits_npz)}, steps=4,
                      batch_size=8, lr=0.05, trial_dir=str(tmp_path / "e"), async_checkpoints=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = trainer_module.Trainer(cfg, torch.device("cpu"))
        trainer.attach(trainer_module.DistEnv(0, 1, 0))
        batches = len(trainer.val_set) // trainer_module.EVAL_BATCH_MIN
        monkeypatch.setattr(trainer_module, "PROGRESS_EVERY_S", 0.0)
        written = []
        write = trainer.write_progress
        monkeypatch.setattr(trainer, "write_progress", lambda state: (write(state), written.append(read_progress(tmp_path / "e"))))
        trainer.evaluate()
        trainer.close()
    finally:
        dist.destroy_process_group()
    assert batches >= 1 and len(written) >= batches
    assert all(p.state == "running" and p.step == 0 for p in written)
    assert sorted(p.updated for p in written) == [p.updated for p in written]


def test_a_reader_on_another_host_judges_by_change_not_by_its_clock():
    """The campaign watching a trial across nodes reads a progress file written with a node's
    clock, which may be far from its own: what the file held at the launch is an earlier
    segment's, any change is this one's."""
    before = progress_now("running", 40, 100, 2, 8, {})
    behind = Progress(**{**before.__dict__, "step": 41, "updated": before.updated - 3600.0})  # a node an hour behind
    assert seen_since(before, before) == Seen(None, 40)
    assert seen_since(behind, before) == Seen("running", 41, None, behind.updated)
    assert seen_since(None, None) == Seen(None, 0) and seen_since(before, None).state == "running"


def test_a_restart_that_no_progress_says_gets_its_floor_until_a_step_past_it():
    """torchrun across nodes going on without a lost node restarts from a checkpoint and writes
    no "resizing": the campaign says so, and the clock allows the floor given from then."""
    clock = StallClock(20.0, launched_at=0.0)
    assert clock.observe(running(50, updated=1.0), 1.0) is None
    clock.restarted(50, 900.0, now=10.0)
    assert clock.observe(running(50, updated=1.0), 909.0) is None
    assert clock.observe(running(50, updated=1.0), 911.0).resizing
    clock = StallClock(20.0, launched_at=0.0)
    clock.restarted(50, 900.0, now=10.0)
    assert clock.observe(running(51, updated=100.0), 100.0) is None  # a step past it: its own limit again
    assert clock.observe(running(51, updated=100.0), 121.0).reason == "stalled at step 51 for 21 s"


def test_null_never_stalls():
    clock = StallClock(None, launched_at=0.0)
    assert clock.limit_s() is None
    assert clock.observe(Seen(None, 0), 1e9) is None
    assert clock.observe(running(5), 2e9) is None and clock.observe(running(5), 9e9) is None


def test_the_default_is_a_floor_a_multiple_of_the_step_time_and_of_the_longest_gap():
    assert default_limit_s(None, 0.0) == FLOOR_S == 300.0
    assert default_limit_s(0.1, 2.0) == 300.0  # fast steps: the floor
    assert default_limit_s(60.0, 0.0) == 600.0  # 10 step times
    assert default_limit_s(1.0, 200.0) == 600.0  # 3 times the longest wait between two steps


def test_auto_learns_its_limit_from_the_trial():
    clock = StallClock(AUTO, launched_at=0.0)
    assert clock.limit_s() == FLOOR_S  # before the first step: imports, compile, data loading
    assert clock.observe(Seen(None, 0), 299.0) is None
    assert clock.observe(running(0), 250.0) is None  # its first write, after a long start...
    assert clock.observe(running(1, step_time_s=1.0), 251.0) is None
    assert clock.limit_s() == FLOOR_S  # ...does not count as a wait between steps
    clock.observe(running(2, step_time_s=1.0), 252.0)
    clock.observe(running(3, step_time_s=1.0), 402.0)  # an evaluation: 150 s for one step
    assert clock.limit_s() == 450.0
    assert clock.observe(running(3), 402.0 + 449.0) is None  # the next evaluation may take as long again, and more
    assert clock.observe(running(3), 402.0 + 451.0).reason == "stalled at step 3 for 451 s"
    slow = StallClock(AUTO, launched_at=0.0)
    slow.observe(running(7, step_time_s=90.0), 1.0)
    assert slow.limit_s() == 900.0
    assert slow.observe(running(7), 899.0) is None and slow.observe(running(7), 902.0) is not None


# --- the spec --------------------------------------------------------------------------------

SPEC = {"campaign": {"name": "w"}, "data": {"path": "data/digits.npz"}, "model": {"name": "mlp", "width": 8},
        "training": {"steps": 20, "batch_size": 16, "lr": 0.1}}


def spec_with(value):
    return parse_spec({**SPEC, "training": {**SPEC["training"], "stall_timeout_s": value}})


def test_the_setting_is_seconds_null_or_auto_and_reaches_the_trial_config(tmp_path):
    from cluster.sizing import SizedRequest
    from flows.run.campaign import trial_config
    from tasks.grid import expand_grid

    assert parse_spec(SPEC).training.stall_timeout_s == AUTO
    assert spec_with(None).training.stall_timeout_s is None
    assert spec_with(45).training.stall_timeout_s == 45.0
    for bad in (0, -5, "soon", True, float("inf")):
        message = str(pytest.raises(SpecError, spec_with, bad).value)
        assert "training.stall_timeout_s" in message and "must be a number of seconds in (0, " in message, message
    (trial,) = expand_grid(spec_with(45))
    config = trial_config(spec_with(45), trial, tmp_path / trial.id, None, SizedRequest(trial.id, 1, 1, (0,)))
    assert config.stall_timeout_s == 45.0
    assert json.loads(config.to_json())["stall_timeout_s"] == 45.0  # the trial's config file says it too
    # How long a stall is waited out is not part of what is trained: the trial keeps its id.
    assert {t.id for t in expand_grid(parse_spec(SPEC))} == {trial.id} == {t.id for t in expand_grid(spec_with(None))}


# --- the stack dump and stop, on real processes ------------------------------------------------

HANGS = textwrap.dedent("""
    import subprocess, threading
    from training.process import dump_stacks_on_request

    def wait_forever():
        threading.Event().wait()

    dump_stacks_on_request()
    child = subprocess.Popen(["sleep", "600"])  # in the group too, and SIGUSR1 would kill it: not sent it
    print(child.pid, flush=True)
    wait_forever()
""")


def start_hanging_trial(tmp_path: Path) -> tuple[subprocess.Popen, int, Path]:
    log = tmp_path / "train.log"
    proc = subprocess.Popen([sys.executable, "-c", HANGS], stdout=subprocess.PIPE, stderr=open(log, "ab"), start_new_session=True,
                            text=True, cwd=Path(__file__).resolve().parent.parent)
    sleeper = int(proc.stdout.readline())
    return proc, sleeper, log


def test_the_stacks_go_to_the_log_and_only_processes_that_catch_it_are_signalled(tmp_path):
    proc, sleeper, log = start_hanging_trial(tmp_path)
    try:
        assert catches(proc.pid, signal.SIGUSR1) and not catches(sleeper, signal.SIGUSR1)
        # The pid is printed just before the call: dump until the stack is inside it (each dump leaves it running).
        wait_for(lambda: dump_stacks([proc.pid], log) == [proc.pid] and "in wait_forever" in log.read_text(), 60,
                 "a dump from inside wait_forever")
        assert proc.poll() is None and os.path.exists(f"/proc/{sleeper}")  # dumped, not ended
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def watched_until_stopped(tmp_path: Path, *written: tuple[str, int]) -> tuple[Watchdog, str]:
    """A hanging trial under a 1 s watchdog, its progress file written with each (state, step)
    and then never again; the watchdog and the trial's log once the watchdog has stopped it."""
    proc, _, log = start_hanging_trial(tmp_path)
    try:
        with Watchdog(tmp_path, 1.0, log, lambda: [proc.pid], every_s=0.1) as watchdog:
            for state, step in written:
                progress_now(state, step, 10, 1, 8, {"step_time_s": 0.01}).write(tmp_path)
            proc.wait(timeout=60)  # the segment ends when its processes do: the watchdog stops them
        return watchdog, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_watchdog_dumps_and_stops_a_stalled_segment(tmp_path):
    watchdog, text = watched_until_stopped(tmp_path, ("running", 3))
    assert watchdog.stall is not None and watchdog.stall.reason.startswith("stalled at step 3 for ")
    assert not watchdog.stall.silent
    assert "stalled at step 3" in text and "in wait_forever" in text


def test_the_watchdog_stops_a_finished_segment_whose_teardown_hangs(tmp_path):
    watchdog, text = watched_until_stopped(tmp_path, ("running", 9), ("finished", 10))  # then it never exits
    assert watchdog.stall is not None and watchdog.stall.finished
    assert "finished at step 10, but its processes were still there" in text


def test_a_process_group_that_comes_after_the_stall_is_stopped_too(tmp_path):
    """Stalled before its process was started (a worker still forking): it is stopped once it is there."""
    from conftest import wait_for

    groups: list[int] = []
    with Watchdog(tmp_path, 0.2, tmp_path / "train.log", lambda: list(groups), every_s=0.05) as watchdog:
        wait_for(lambda: watchdog.stall is not None, 30, "the stall")
        assert watchdog.stall.silent
        proc, _, _ = start_hanging_trial(tmp_path)
        groups.append(proc.pid)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert "in wait_forever" in (tmp_path / "train.log").read_text()


def test_a_segment_without_a_stall_ends_its_watchdog_with_it(tmp_path):
    with Watchdog(tmp_path, 3600.0, tmp_path / "train.log", lambda: [], every_s=0.05) as watchdog:
        pass
    assert watchdog.stall is None and not watchdog._thread.is_alive()


# --- a campaign: the stalled trial fails, the one queued behind it runs --------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("warm", [True, False], ids=["warm worker", "torchrun"])
def test_a_stalled_trial_is_dumped_stopped_and_failed_and_the_next_one_runs(tmp_path, digits_npz, warm):
    """A warm worker runs the trial in its own process group; torchrun's workers lead sessions
    of their own under it, found as its descendants."""
    from conftest import campaign_cli
    from tasks.records import campaign_status, read_allocations, read_trial_record
    from training.layout import trial_files
    from user_workload import PACKAGE, write_package

    write_package(tmp_path)
    runs = tmp_path / "runs"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "hang"}, "data": {"path": str(digits_npz)},
        "model": {"target": f"{PACKAGE}.nets:stalls_at", "kwargs": {"step": 0}},
        # Seconds: long enough for a trial's start on a loaded host (the clock runs from its launch).
        "training": {"steps": 30, "batch_size": 16, "lr": 0.05, "checkpoint_every": 10, "eval_every": 30, "stall_timeout_s": 20},
        "grid": {"model.kwargs.step": [3, 0]},  # the first hangs at step 3; the second never does
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1, "warm_workers": warm},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(runs), "summary": str(tmp_path / "s.json")},
    }))
    launch = subprocess.run([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"})
    output = launch.stdout[-3000:] + launch.stderr[-3000:]
    assert launch.returncode != 0, output  # a failed trial fails the campaign's run (the rest still ran)
    statuses = {s.label: s for s in campaign_status(runs, "hang")}
    stalled, healthy = statuses["step=3"], statuses["step=0"]
    assert stalled.state == "failed" and stalled.reason.startswith("stalled at step"), (stalled, output)
    assert read_trial_record(runs / "hang" / stalled.trial_id).attempts == 1  # not retried into the same hang
    log = trial_files(runs / "hang" / stalled.trial_id).log.read_text()
    assert "in wait_forever" in log and "in forward" in log, log[-3000:]  # the Python stacks, where it blocked
    assert healthy.state == "finished" and healthy.step == 30, (healthy, output)
    # It ran on the device after the stalled one gave it back.
    events = [(e.trial, e.reason) for e in read_allocations(runs / "hang")]
    assert events.index((stalled.trial_id, "failed")) < events.index((healthy.trial_id, "start")), events
    shown = campaign_cli("status", "hang", "--runs-dir", str(runs), cwd=tmp_path)
    assert f"trial {stalled.trial_id} failed: stalled at step" in " ".join(shown.stdout.split()), shown.stdout + shown.stderr


@pytest.mark.slow
def test_a_resize_whose_next_generation_hangs_is_stopped_answered_and_queued_again(tmp_path, digits_npz, monkeypatch):
    """A [1, 2]-device trial grown by hand while held at step 100: its generation on two
    processes hangs at its first step, while its progress still says "resizing" (a new
    generation does until its first step). Past the limit the trial is stopped, its stacks in
    its log, queued again (not failed), starts afresh from its last checkpoint and finishes
    (the model hangs only once)."""
    import contextlib
    import threading

    from cluster.inventory import discover
    from cluster.leases import LeaseStore
    from flows.run.campaign import HOLD_ENV, campaign_flow
    from tasks.records import read_trial_record
    from tasks.watchdog import RESIZE_FLOOR_ENV
    from training.files import read_json
    from training.layout import trial_files
    from user_workload import PACKAGE, write_package

    write_package(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(HOLD_ENV, "100")
    monkeypatch.setenv(RESIZE_FLOOR_ENV, "5")  # below the limit: the limit (45 s) decides
    runs = tmp_path / "runs"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "regrow"}, "data": {"path": str(digits_npz)},
        "model": {"target": f"{PACKAGE}.nets:hangs_once_grown", "kwargs": {"marker": str(tmp_path / "hung-once")}},
        # Seconds: a launch on a loaded host writes its first progress well within them.
        "training": {"steps": 300, "batch_size": 30, "lr": 0.05, "checkpoint_every": 50, "eval_every": 300,
                     "stall_timeout_s": 45},
        "resources": {"devices": [1, 2]}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(runs), "summary": str(tmp_path / "s.json")},
    }))
    answered: list[subprocess.CompletedProcess] = []
    # Another campaign holds the second slot, so the trial starts on one (renewed while held).
    slots = discover(cpu_slots=2)
    capacity = {d.id: d.memory_bytes for d in slots.devices}
    someone_else = contextlib.ExitStack()
    someone_else.enter_context(LeaseStore().hold("someone-else/x", {slots.devices[1].id: capacity[slots.devices[1].id]}, capacity))

    def grow_while_held():
        record = wait_for(lambda: read_json(runs / "regrow" / "campaign.json"), 120, "the campaign's record")
        trial_dir = runs / "regrow" / record["trials"][0]["id"]
        trial_dir.mkdir(parents=True, exist_ok=True)
        trial_files(trial_dir).hold.touch()
        wait_for(lambda: (read_json(trial_dir / "progress.json") or {}).get("state") == "held", 120, "the trial held")
        someone_else.close()
        answered.append(subprocess.run([sys.executable, "-m", "flows.cli", "resize", record["trials"][0]["id"], "2",
                                        "--runs-dir", str(runs), "--wait-s", "300"], capture_output=True, text=True, timeout=360))
        trial_files(trial_dir).hold.unlink()

    driver = threading.Thread(target=grow_while_held)
    driver.start()
    try:
        summary = campaign_flow(str(tmp_path / "params.yaml"))
    finally:
        driver.join()
        someone_else.close()
    said = answered[0].stdout + answered[0].stderr
    assert answered[0].returncode == 0 and "now on" in said, said  # the grow landed: its generation started, then hung
    assert (tmp_path / "hung-once").exists()
    assert summary["finished"] == 1, summary
    (trial_id,) = [t["id"] for t in read_json(runs / "regrow" / "campaign.json")["trials"]]
    record = read_trial_record(runs / "regrow" / trial_id)
    assert record.state == "finished" and record.attempts >= 2, record
    log = trial_files(runs / "regrow" / trial_id).log.read_text()
    assert "stalled in a resize at step" in log and "wait_forever" in log, log[-3000:]  # two processes: their dumps interleave

