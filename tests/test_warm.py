"""Warm workers: one-device trials one after another in one process, exactly as torchrun runs them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import wait_for
from training.process import group_alive
import torch

from cluster.leases import LeaseStore
from tasks import trial as trial_module
from tasks.trial import accept_launches, apply_launch, close_warm_workers, plan_launch, stop_launched_trials
from training.checkpoint import load_model_weights
from training.config import TrialConfig
from training.workload import build_model
from training.layout import trial_files



def config(trial_dir: Path, digits: Path, **overrides) -> TrialConfig:
    base = dict(trial_id=trial_dir.name, seed=5, model={"name": "small_cnn", "width": 8, "dropout": 0.1}, data={"path": str(digits)},
                steps=40, batch_size=32, lr=0.05, warmup_steps=4, checkpoint_every=20, eval_every=40, trial_dir=str(trial_dir))
    return TrialConfig(**{**base, **overrides})


def weights(cfg: TrialConfig) -> dict[str, torch.Tensor]:
    result = json.loads(Path(cfg.result_path).read_text())
    return load_model_weights(Path(result["checkpoint"]), build_model(cfg.model)).state_dict()


def torchrun(cfg: TrialConfig) -> dict[str, torch.Tensor]:
    Path(cfg.trial_dir).mkdir(parents=True)
    (Path(cfg.trial_dir) / "trial.json").write_text(cfg.to_json())
    done = subprocess.run([sys.executable, "-m", "training.launch", "--standalone", "--nproc-per-node=1", "-m", "training.train",
                           "--config", str(Path(cfg.trial_dir) / "trial.json")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return weights(cfg)


def warm(cfg: TrialConfig, tmp_path: Path) -> int:
    Path(cfg.trial_dir).mkdir(parents=True, exist_ok=True)
    plan = plan_launch(cfg, [_slot()], tmp_path, warm=True)
    assert plan.warm and plan.command[-1] == trial_module.WORKER_MODULE
    return apply_launch(plan, cfg)



def test_a_warm_worker_trains_one_trial_after_another_each_in_its_own_log(tmp_path, digits_npz):
    """The quick version (`make test-fast`): two tiny trials through one worker process."""
    tiny = dict(model={"name": "mlp", "width": 4}, steps=2, checkpoint_every=2, eval_every=2, warmup_steps=0)
    first, second = (config(tmp_path / name, digits_npz, **tiny, lr=lr) for name, lr in (("first", 0.05), ("second", 0.1)))
    accept_launches()
    try:
        assert warm(first, tmp_path) == 0
        (worker,) = [w for ws in trial_module._idle_workers.values() for w in ws]
        assert warm(second, tmp_path) == 0
        assert [w.proc.pid for ws in trial_module._idle_workers.values() for w in ws] == [worker.proc.pid]
    finally:
        close_warm_workers()
    assert worker.proc.returncode == 0  # end of its input: it exits on its own
    for cfg in (first, second):
        assert json.loads(Path(cfg.result_path).read_text())["steps"] == 2
        assert cfg.trial_id in (Path(cfg.trial_dir) / "train.log").read_text()


CAPACITY = {"cpu0": 2}


def successor(cfg: TrialConfig, tmp_path: Path, store: LeaseStore, after: str, *, claims: dict | None = None, take_over=None,
              seen: list | None = None) -> trial_module.Successor:
    """A trial staged after `after` (its lease holder: `after`'s name), as CampaignRun.stage makes one: its
    worker moves the device's lease to `c/<trial>` itself; the campaign adopts what it granted."""
    holder = f"c/{cfg.trial_id}"
    lease = {"db": str(store.path), "timeout_s": store.heartbeat_timeout_s, "holder": holder, "instead_of": f"c/{after}",
             "claims": claims or CAPACITY, "capacity": CAPACITY, "pid": os.getpid(), "campaign": "c"}

    def adopt(grant):
        store.adopt(holder, grant)
        seen.append((cfg.trial_id, [l.holder for l in store.leases()]))
        return dataclasses.replace(cfg, lease=store.fence(holder))

    return trial_module.Successor(plan_launch(cfg, [_slot()], tmp_path, warm=True), cfg, lease, take_over or (lambda: None), adopt,
                                  lambda: store.release(holder))


def test_a_staged_trial_starts_in_the_worker_as_the_one_before_it_ends_under_the_lease_it_passes_on(tmp_path, digits_npz):
    """tasks/warm_worker.py: once the first trial's result is written, its worker itself moves
    the device's lease to the staged trial (one transaction of the lease file) and starts it,
    before the trial's launch is applied (which finds it running and waits for its end); the
    campaign adopts the grant. A trial staged after its predecessor ended goes through the
    campaign's take-over, which may say no: the worker then waits idle, and the third trial is
    launched the usual way."""
    tiny = dict(model={"name": "mlp", "width": 4}, steps=2, checkpoint_every=2, eval_every=2, warmup_steps=0)
    first, second, third = (config(tmp_path / name, digits_npz, **tiny) for name in ("first", "second", "third"))
    store = LeaseStore(tmp_path / "leases.db")
    assert store.acquire("c/first", CAPACITY, CAPACITY)
    first = dataclasses.replace(first, lease=store.fence("c/first"))
    seen, asked = [], []
    accept_launches()
    try:
        trial_module.stage_successor("first", successor(second, tmp_path, store, "first", seen=seen))
        assert warm(first, tmp_path) == 0
        assert seen == [("second", ["c/second"])]  # the device passed on: the first's lease gone, in the same transaction
        assert trial_module.handed_over("second") is not None  # running before its launch
        written = TrialConfig.from_file(trial_files(second.trial_dir).config)
        assert written.lease == store.fence("c/second") and written.lease["epoch"] > first.lease["epoch"]  # fenced on its own grant
        assert trial_module.ticket_taken("first") and not trial_module.ticket_taken("second")
        (pgid,) = [g for g, t in trial_module._live_groups.items() if t == "second"]
        assert warm(second, tmp_path) == 0 and trial_module.handed_over("second") is None

        def no():
            asked.append(Path(second.result_path).exists())
            return None
        trial_module.stage_successor("second", successor(third, tmp_path, store, "second", take_over=no, seen=seen))  # it ended: at once
        assert asked == [True] and trial_module.handed_over("third") is None
        (worker,) = [w for ws in trial_module._idle_workers.values() for w in ws]
        assert worker.proc.pid == pgid  # the one worker served both, and waits
        assert warm(third, tmp_path) == 0
    finally:
        close_warm_workers()
    for cfg in (first, second, third):
        assert json.loads(Path(cfg.result_path).read_text())["steps"] == 2
        assert (Path(cfg.trial_dir) / "train.log").read_text().count("fresh start") == 1


def test_a_worker_that_cannot_have_the_device_passed_on_starts_nothing_and_gives_the_ended_trial_s_back(tmp_path, digits_npz):
    """Another holder shares the device, and the staged trial wants it whole: the worker's lease
    transaction gives the first trial's share back and grants nothing; the worker says so,
    starts nothing and waits idle; the second trial is launched the usual way."""
    tiny = dict(model={"name": "mlp", "width": 4}, steps=2, checkpoint_every=2, eval_every=2, warmup_steps=0)
    first, second = (config(tmp_path / name, digits_npz, **tiny) for name in ("first", "second"))
    store = LeaseStore(tmp_path / "leases.db")
    assert store.acquire("c/first", {"cpu0": 1}, CAPACITY) and store.acquire("other/x", {"cpu0": 1}, CAPACITY)
    first = dataclasses.replace(first, lease=store.fence("c/first"))
    seen = []
    accept_launches()
    try:
        trial_module.stage_successor("first", successor(second, tmp_path, store, "first", seen=seen))
        assert warm(first, tmp_path) == 0
        assert seen == [] and trial_module.handed_over("second") is None
        assert [l.holder for l in store.leases()] == ["other/x"]
        (worker,) = [w for ws in trial_module._idle_workers.values() for w in ws]
        assert worker.reply == {"code": 0, "next": {"trial": "second", "started": False}}
        assert warm(second, tmp_path) == 0
    finally:
        close_warm_workers()
    assert json.loads(Path(second.result_path).read_text())["steps"] == 2


def test_a_staged_trial_s_ticket_is_its_worker_s_or_its_campaign_s_never_both(tmp_path, digits_npz):
    """Unstaging removes the ticket unless the worker took it first (a rename): then it says
    no, and the heartbeat counts the ended trial's lease as passed on, not lost."""
    from tasks.warm_worker import take_ticket

    store = LeaseStore(tmp_path / "leases.db")
    staged = successor(config(tmp_path / "second", digits_npz), tmp_path, store, "first", seen=[])
    try:
        trial_module.stage_successor("first", staged)
        ticket = trial_module._ticket_path("first")
        assert json.loads(ticket.read_text())["lease"]["holder"] == "c/second"
        assert trial_module.unstage_successor("first") and not ticket.exists()
        assert take_ticket(str(ticket)) is None  # the worker finds none
        trial_module.stage_successor("first", staged)
        assert take_ticket(str(ticket))["trial"] == "second"
        assert not trial_module.unstage_successor("first") and trial_module.ticket_taken("first")
        trial_module._successors.clear()

        class Failed:  # the first trial's worker, after the trial raised: it is discarded
            proc, reply, alive, discarded = type("P", (), {"pid": -1})(), {}, False, False

            def discard(self):
                self.discarded = True

        trial_module.stage_successor("again", staged)
        worker = Failed()
        trial_module._after_trial(worker, dataclasses.replace(staged.config, trial_id="again"), 1)
        assert worker.discarded and not trial_module._ticket_path("again").exists()  # a retry's worker finds no ticket
    finally:
        trial_module._successors.clear()
        close_warm_workers()
    assert not ticket.parent.exists()  # the campaign's tickets go with it


def test_a_worker_started_ahead_serves_the_first_trial_in_the_environment_of_then(tmp_path, digits_npz, monkeypatch):
    """`campaign launch` starts the zygote of the first trials' workers before its loop (it
    imports while the campaign starts); each worker is forked from it, and what the campaign
    sets in its environment meanwhile (its metrics hub, here the checkpoint key) reaches the
    trial as it would a process started for it."""
    from tasks.trial import prestart_warm_workers
    from training.manifest import KEY_ENV

    tiny = dict(model={"name": "mlp", "width": 4}, steps=2, checkpoint_every=2, eval_every=2, warmup_steps=0)
    cfg = config(tmp_path / "first", digits_npz, **tiny)
    accept_launches()
    try:
        prestart_warm_workers([_slot()], tmp_path)
        (zygote,) = trial_module._zygotes.values()
        key = tmp_path / "set-after-the-zygote-started.key"
        monkeypatch.setenv(KEY_ENV, str(key))
        assert warm(cfg, tmp_path) == 0
        (served,) = [w for ws in trial_module._idle_workers.values() for w in ws]
        assert parent_of(served.proc.pid) == zygote.proc.pid  # forked from the zygote started ahead, not started anew
        assert warm(config(tmp_path / "second", digits_npz, **tiny), tmp_path) == 0
        assert [w.proc.pid for ws in trial_module._idle_workers.values() for w in ws] == [served.proc.pid]  # kept warm
    finally:
        close_warm_workers()
    assert zygote.proc.returncode is not None and served.proc.returncode == 0  # both ended with the campaign
    assert json.loads(Path(cfg.result_path).read_text())["steps"] == 2
    assert key.exists()  # its checkpoint was signed with the key named after the worker started


def test_workers_are_started_ahead_where_the_first_one_device_trials_will_be_placed(tmp_path, digits_npz):
    from cluster.inventory import discover
    from flows.run.campaign import checked_requests, warm_first_wave
    from tasks.grid import expand_grid
    from training.spec import parse_spec

    raw = {"campaign": {"name": "ahead"}, "data": {"path": str(digits_npz)}, "model": {"name": "mlp", "width": 4},
           "training": {"steps": 2, "batch_size": 16, "lr": 0.05, "eval_every": 2, "checkpoint_every": 2},
           "grid": {"training.lr": [0.01, 0.02, 0.03]}, "resources": {"devices": 1}, "cluster": {"cpu_slots": 2},
           "tracking": {"runs_dir": str(tmp_path / "runs")}}
    spec = parse_spec(raw)
    slots = discover(cpu_slots=2)
    trials = expand_grid(spec)
    requests = checked_requests(spec, trials, slots)
    ids = lambda devices: sorted(d.id for d in devices)
    assert ids(warm_first_wave(spec, trials, slots, requests, {})) == ids(slots.devices)  # three trials, two slots
    taken = slots.devices[0]
    assert ids(warm_first_wave(spec, trials, slots, requests, {taken.id: taken.memory_bytes})) == [slots.devices[1].id]
    assert len(warm_first_wave(spec, trials[:1], slots, requests, {})) == 1
    cold = parse_spec({**raw, "cluster": {"cpu_slots": 2, "warm_workers": False}})
    assert warm_first_wave(cold, trials, slots, requests, {}) == []


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_forked_worker_that_dies_mid_trial_is_reported_with_its_signal_and_not_kept(tmp_path, digits_npz):
    """The zygote, the worker's parent, reports how it ended: a worker killed during its
    trial gives the trial the kill's code (as a process started on its own would), and the
    next trial gets a new worker forked from the same zygote."""
    import signal

    held = config(tmp_path / "held", digits_npz, model={"name": "mlp", "width": 4}, steps=4, checkpoint_every=2, eval_every=4,
                  warmup_steps=0, hold_at_step=2)
    hold = trial_files(held.trial_dir).hold
    hold.parent.mkdir(parents=True)
    hold.touch()
    accept_launches()
    codes = []
    try:
        runner = threading.Thread(target=lambda: codes.append(warm(held, tmp_path)))
        runner.start()
        progress = trial_files(held.trial_dir).progress
        wait_for(lambda: progress.exists() and json.loads(progress.read_text())["state"] == "held", 120, "the trial held at step 2")
        (zygote,) = trial_module._zygotes.values()
        (pid,) = list(trial_module._live_groups)
        assert parent_of(pid) == zygote.proc.pid
        os.kill(pid, signal.SIGKILL)
        runner.join(60)
        assert codes == [-signal.SIGKILL]
        assert not [w for ws in trial_module._idle_workers.values() for w in ws]  # a dead worker is not kept
        tiny = config(tmp_path / "after", digits_npz, model={"name": "mlp", "width": 4}, steps=2, checkpoint_every=2, eval_every=2,
                      warmup_steps=0)
        assert warm(tiny, tmp_path) == 0
        (worker,) = [w for ws in trial_module._idle_workers.values() for w in ws]
        assert parent_of(worker.proc.pid) == zygote.proc.pid
    finally:
        close_warm_workers()


def test_a_campaign_killed_outright_takes_its_zygote_and_forked_workers_with_it(tmp_path):
    """SIGKILL to the campaign runs none of its cleanup: the zygote sees its socket close and
    exits, and its workers die with it (their parent-death signal)."""
    import textwrap

    campaign = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from tasks.trial import WarmWorker, _warm_command, _zygotes
        from cluster.inventory import discover
        worker = WarmWorker(*_warm_command(discover(cpu_slots=1).devices[0], sys.executable), Path({str(tmp_path)!r}))
        (zygote,) = _zygotes.values()
        print(zygote.proc.pid, worker.proc.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    zygote, worker = map(int, campaign.stdout.readline().split())
    assert parent_of(worker) == zygote
    campaign.kill()
    campaign.wait()
    gone = lambda pid: not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    wait_for(lambda: gone(zygote) and gone(worker), 60, "the zygote and its worker to end with the campaign")


def _slot():
    from cluster.inventory import discover

    return discover(cpu_slots=1).devices[0]


@pytest.mark.slow  # real trainers, torchrun
def test_trials_in_one_warm_worker_match_torchrun_bit_for_bit(tmp_path, digits_npz):
    """An `exact` trial, then another with other settings, in one process: each trains what
    a fresh torchrun process trains (nothing leaks from one trial to the next)."""
    first = config(tmp_path / "warm" / "first", digits_npz, reduction="exact")
    second = config(tmp_path / "warm" / "second", digits_npz, seed=6, lr=0.1, model={"name": "mlp", "width": 32, "dropout": 0.2})
    accept_launches()
    try:
        assert warm(first, tmp_path) == 0
        (worker,) = [w for ws in trial_module._idle_workers.values() for w in ws]
        assert warm(second, tmp_path) == 0
        assert [w.proc.pid for ws in trial_module._idle_workers.values() for w in ws] == [worker.proc.pid]  # the same process
    finally:
        close_warm_workers()
    assert "fresh start" in (Path(second.trial_dir) / "train.log").read_text()  # each trial's output in its own log
    for cfg in (first, second):
        alone = torchrun(config(tmp_path / "torchrun" / Path(cfg.trial_dir).name, digits_npz,
                                **{k: getattr(cfg, k) for k in ("seed", "lr", "model", "reduction")}))
        ours = weights(cfg)
        for name in alone:
            assert torch.equal(alone[name], ours[name]), (cfg.trial_id, name)


@pytest.mark.slow  # a real trainer, held and stopped
def test_a_stopping_campaign_ends_a_busy_warm_worker(tmp_path, digits_npz):
    held = config(tmp_path / "held", digits_npz, steps=400, hold_at_step=10)
    Path(held.trial_dir).mkdir(parents=True)
    trial_files(held.trial_dir).hold.touch()
    accept_launches()
    codes = []
    runner = threading.Thread(target=lambda: codes.append(warm(held, tmp_path)))
    runner.start()
    deadline = time.time() + 120
    while (json.loads(Path(held.progress_path).read_text()) if Path(held.progress_path).exists() else {}).get("state") != "held":
        assert time.time() < deadline, (Path(held.trial_dir) / "train.log").read_text()[-2000:]
        time.sleep(0.05)
    (pgid,) = trial_module._live_groups
    assert stop_launched_trials(grace_s=5) == ["held"]
    assert not group_alive(pgid)
    runner.join(timeout=30)
    assert codes and codes[0] != 0 and not trial_module._idle_workers.get(trial_module.warm_key(plan_launch(held, [_slot()], tmp_path, warm=True)))
    accept_launches()
    close_warm_workers()


def test_two_answers_that_come_together_are_both_read_the_second_after_the_first():
    """A worker that started the next trial itself answers for both, one line after the other,
    and the second may be in the pipe before the first is read: each `wait` returns its own
    answer, the second without waiting on a pipe that has nothing more to say."""

    class Alive:
        returncode = None

        def poll(self):
            return None

    reply_read, reply_write = os.pipe()
    worker = object.__new__(trial_module.WarmWorker)
    worker.proc, worker.reply, worker._unread = Alive(), {}, b""
    worker.replies = trial_module._reply_reader(reply_read)
    os.write(reply_write, b'{"code": 0, "next": {"trial": "b", "started": true}}\n{"code": 0}\n')
    codes = []
    reader = threading.Thread(target=lambda: codes.extend([worker.wait(), worker.reply, worker.wait(), worker.reply]), daemon=True)
    reader.start()
    reader.join(30)
    try:
        assert codes == [0, {"code": 0, "next": {"trial": "b", "started": True}}, 0, {"code": 0}]
    finally:
        os.close(reply_write)
        worker.replies.close()
