"""Fault injection and hostile input: each case is refused before it can do harm."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from training.spec import SpecError, load_spec
from training.checkpoint import Checkpointer
from training.files import write_json_atomic
from training.manifest import MANIFEST, latest_valid_checkpoint, list_checkpoints, verify
from training.process import group_alive
from training.workload import WorkloadError, check_workload


def spec_text(extra: str = "") -> str:
    return ("campaign: {name: t}\nmodel: {name: small_cnn}\ntraining: {steps: 10, batch_size: 8, lr: 0.1}\n" + extra)


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(spec_text("\n".join(lines) + "\n"))
    started = time.perf_counter()
    with pytest.raises(SpecError, match=r"YAML aliases \(\*a\) are not allowed"):
        load_spec(bomb)
    assert time.perf_counter() - started < 2.0


def test_a_huge_or_binary_spec_is_refused(tmp_path):
    huge = tmp_path / "huge.yaml"
    huge.write_text(spec_text("# " + "x" * (2 << 20) + "\n"))
    with pytest.raises(SpecError, match="more than the 1048576 allowed: a campaign spec is a regular file of at most"):
        load_spec(huge)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SpecError, match="not a text file"):
        load_spec(binary)
    with pytest.raises(SpecError, match="is a directory, not a regular file"):
        load_spec(tmp_path)


def test_an_unreachable_mlflow_server_is_refused_before_anything_runs(tmp_path, digits_npz):
    import socket

    from conftest import campaign_cli

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "params.yaml").write_text(spec_text(
        f"data: {{path: {digits_npz}}}\ntracking: {{mlflow_uri: 'http://127.0.0.1:{port}', runs_dir: runs}}\n"))
    started = time.perf_counter()
    done = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    assert done.returncode == 2 and "tracking.mlflow_uri: cannot reach the MLflow server" in done.stderr, done.stderr
    assert time.perf_counter() - started < 60
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


@pytest.mark.parametrize("kind", ["text", "pickle"])
def test_a_data_file_that_is_not_a_digits_npz_is_refused(tmp_path, kind):
    path = tmp_path / "data.npz"
    if kind == "text":
        path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    else:  # an .npz whose array is a pickled object: np.load refuses to unpickle it
        buf = io.BytesIO()
        np.savez(buf, train_x=np.array([object()], dtype=object))
        path.write_bytes(buf.getvalue())
    with pytest.raises(WorkloadError, match=r"data.path: .* is not a prepared digits .npz"):
        check_workload(model={"name": "small_cnn"}, data={"path": str(path)}, loss={"name": "cross_entropy"},
                       optimizer={"name": "SGD"}, lr=0.1)


def test_records_are_readable_by_others_like_any_file(tmp_path):
    from training import files

    write_json_atomic(tmp_path / "record.json", {"a": 1})
    # As open() would make it under this process's umask (0644 under the usual 022), not mkstemp's 0600.
    assert (tmp_path / "record.json").stat().st_mode & 0o777 == 0o666 & ~files._UMASK


# --- checkpoints: only whole ones, signed by this host, ever load ----------------------------

def two_checkpoints(root: Path) -> list[Path]:
    saver = Checkpointer(root, keep=3, rank=0, world_size=1)
    for step in (10, 20):
        saver.save(step, {"trainer": {"w": torch.full((4,), float(step))}}, blocking=True)
    found = list_checkpoints(root)
    assert [verify(p) for p in found] == [None, None]
    return found


def reseal_without_key(directory: Path) -> None:
    """What an attacker who can write the folder can do: recompute every checksum."""
    manifest = json.loads((directory / MANIFEST).read_text())
    for p in directory.iterdir():
        if p.name != MANIFEST:
            manifest["files"][p.name] = {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "bytes": p.stat().st_size}
    (directory / MANIFEST).write_text(json.dumps(manifest))


def test_a_tampered_checkpoint_is_refused_even_with_fresh_checksums(tmp_path):
    newest, older = two_checkpoints(tmp_path)
    evil = pickle.dumps(os.system)  # a .metadata that would run code when DCP unpickles it
    (newest / ".metadata").write_bytes(evil)
    reseal_without_key(newest)
    assert "signature does not match" in verify(newest)
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert latest_valid_checkpoint(tmp_path) == older


@pytest.mark.parametrize("manifest", [{}, {"files": 5}, {"step": 20, "files": {}}, [], "x",
                                      {"step": 20, "files": {"../../etc/passwd": {"sha256": "0" * 64, "bytes": 1}}}])
def test_a_wrong_manifest_is_invalid_not_a_crash(tmp_path, manifest):
    newest, older = two_checkpoints(tmp_path)
    (newest / MANIFEST).write_text(json.dumps(manifest))
    assert "malformed" in verify(newest)
    with pytest.warns(UserWarning):
        assert latest_valid_checkpoint(tmp_path) == older


def test_a_file_slipped_into_a_checkpoint_makes_it_invalid(tmp_path):
    newest, older = two_checkpoints(tmp_path)
    (newest / "extra.pkl").write_bytes(b"payload")
    assert verify(newest) == "extra.pkl is not in the manifest"


def test_campaign_status_reports_a_broken_manifest(tmp_path):
    from conftest import campaign_cli
    from tasks.records import CampaignRecord, TrialEntry, update_record, write_campaign

    runs = tmp_path / "runs"
    write_campaign(runs, CampaignRecord(name="broken", trials=(TrialEntry("t1", "x", 20),)))
    trial = runs / "broken" / "t1"
    two_checkpoints(trial / "checkpoints")
    update_record(trial, state="running", devices=["cpu0"])
    (list_checkpoints(trial / "checkpoints")[0] / MANIFEST).write_text("{}")
    write_json_atomic(trial / "result.json", {"checkpoint": str(list_checkpoints(trial / "checkpoints")[0]), "metrics": {}})
    result = campaign_cli("status", "broken", "--runs-dir", str(runs), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


# --- devices: never released while a trial's processes still run ----------------------------

class FlakyStore:
    """A lease store whose database is locked for the first renewals."""

    def __init__(self, failures: int):
        self.failures, self.renewed = failures, []

    def renew(self, holder: str) -> None:
        if self.failures:
            self.failures -= 1
            raise __import__("sqlite3").OperationalError("database is locked")
        self.renewed.append(holder)

    def release(self, holder: str) -> None:
        pass


def test_the_heartbeat_survives_failed_renewals():
    from flows.run.live import LeaseHeartbeat

    store = FlakyStore(failures=3)
    beat = LeaseHeartbeat(store, period_s=0.02)
    beat.add("c/t@1")
    deadline = time.time() + 5
    while not store.renewed and time.time() < deadline:
        time.sleep(0.01)
    assert store.renewed and beat._thread.is_alive()  # it kept renewing after three errors
    beat.close()


def test_a_stopping_campaign_ends_its_trials_before_anything_else(tmp_path):
    import sys
    import threading

    from tasks.trial import LaunchPlan, TrialFailed, accept_launches, apply_launch, stop_launched_trials
    from training.config import TrialConfig

    cfg = TrialConfig(trial_id="sleeper", seed=0, model={"name": "mlp"}, data={"path": "x"}, steps=1, batch_size=1, lr=0.1,
                      trial_dir=str(tmp_path))
    # A trial whose process ignores SIGTERM: the stop must still end it (SIGKILL after the grace).
    ready = tmp_path / "ignoring"
    script = f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w'); time.sleep(120)"
    plan = LaunchPlan([sys.executable, "-c", script], {}, tmp_path, tmp_path / "trial.json", tmp_path / "train.log")
    accept_launches()
    codes = []
    runner = threading.Thread(target=lambda: codes.append(apply_launch(plan, cfg)))
    runner.start()
    deadline = time.time() + 10
    from tasks import trial as trial_module
    while not (trial_module._live_groups and ready.exists()) and time.time() < deadline:
        time.sleep(0.01)
    (pgid,) = trial_module._live_groups
    assert stop_launched_trials(grace_s=0.5) == ["sleeper"]
    assert not group_alive(pgid)  # gone before the caller may release the leases
    runner.join(timeout=10)
    assert codes == [-9]
    with pytest.raises(TrialFailed, match="the campaign is stopping"):  # a task's retry cannot start it again
        apply_launch(plan, cfg)
    accept_launches()


def start_campaign(tmp_path: Path, digits_npz: Path, name: str):
    """`campaign launch` of one long trial in a subprocess, returned once the trial trains."""
    import subprocess
    import sys

    import yaml

    runs = tmp_path / "runs"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": name}, "data": {"path": str(digits_npz)}, "model": {"name": "small_cnn", "width": 8},
        "training": {"steps": 100000, "batch_size": 32, "lr": 0.05, "checkpoint_every": 200, "eval_every": 100000},
        "resources": {"devices": 2}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(runs), "summary": str(tmp_path / "s.json")},
    }))
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not list(runs.glob(f"{name}/*/progress.json")):  # the trial is training
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:] if proc.poll() is not None else "slow"
        time.sleep(0.2)
    return proc, runs / name


def mlflow_statuses(tmp_path: Path) -> list[str]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    return sorted(r.info.status for r in client.search_runs([client.get_experiment_by_name("campaigns").experiment_id]))


def test_a_trial_whose_leases_are_reclaimed_stops_at_once(tmp_path):
    """A campaign that cannot renew its leases (reclaimed as expired, the database rebuilt)
    must stop the trial on them, and not launch it again by a task retry: the devices may be
    another campaign's now."""
    import sys
    import threading

    from cluster.leases import LeaseStore
    from flows.run.live import LeaseHeartbeat
    from tasks import trial as trial_module
    from tasks.trial import LaunchPlan, TrialStopped, accept_launches, apply_launch, readmit, revoke
    from training.config import TrialConfig

    store = LeaseStore(tmp_path / "leases.db")
    holder = "c/sleeper@1"
    assert store.acquire(holder, {"cpu0": 1}, {"cpu0": 1})
    cfg = TrialConfig(trial_id="sleeper", seed=0, model={"name": "mlp"}, data={"path": "x"}, steps=1, batch_size=1, lr=0.1,
                      trial_dir=str(tmp_path))
    plan = LaunchPlan([sys.executable, "-c", "import time; time.sleep(120)"], {}, tmp_path, tmp_path / "trial.json", tmp_path / "train.log")
    accept_launches()
    codes = []
    runner = threading.Thread(target=lambda: codes.append(apply_launch(plan, cfg)))
    runner.start()
    wait_until(lambda: "sleeper" in trial_module._live_groups.values(), 10, "not launched")
    lost = []
    beat = LeaseHeartbeat(store, period_s=0.05, on_lost=lambda h: (lost.append(h), revoke(h.split("/")[1].split("@")[0], grace_s=1)))
    beat.add(holder)
    LeaseStore(tmp_path / "leases.db").release(holder)  # as another campaign reclaiming them would
    runner.join(timeout=20)
    assert lost == [holder] and codes and codes[0] < 0  # the trial's processes were ended by a signal
    with pytest.raises(TrialStopped, match="leases were lost"):  # a task retry cannot launch it again
        apply_launch(plan, cfg)
    assert readmit("sleeper") and not readmit("sleeper")
    beat.close()


def test_a_trial_killed_after_its_result_counts_as_finished(tmp_path, monkeypatch):
    """A worker killed after result.json (and its final checkpoint) were written: torchrun
    exits non-zero, but the trial is done, and resume skips it; its record must agree."""
    import sys

    from tasks import trial as trial_module
    from tasks.records import trial_status
    from training.config import TrialConfig

    trial_dir = tmp_path / "t"
    final = two_checkpoints(trial_dir / "checkpoints")[0]
    from training.result import write_result

    result = write_result(trial_dir / "result.json", {"trial_id": "t", "checkpoint": str(final), "steps": 20, "metrics": {"val_loss": 0.5}})
    cfg = TrialConfig(trial_id="t", seed=0, model={"name": "mlp"}, data={"path": "x"}, steps=20, batch_size=1, lr=0.1,
                      trial_dir=str(trial_dir))
    killed = trial_module.LaunchPlan([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                                     {}, tmp_path, trial_dir / "trial.json", trial_dir / "train.log")
    monkeypatch.setattr(trial_module, "plan_launch", lambda *a, **k: killed)
    trial_module.accept_launches()
    assert trial_module.run_trial.fn(cfg, [], str(tmp_path)) == result
    assert trial_status(trial_dir, "t", "t", 20).state == "finished"
    assert json.loads((trial_dir / "record.json").read_text())["state"] == "finished"


def test_a_finished_trial_left_running_in_mlflow_is_settled_on_resume(tmp_path):
    """The campaign was killed between a trial's result and closing its MLflow run: the next
    launch skips the trial and finishes the run, with its final metrics."""
    from mlflow import MlflowClient

    from training.spec import parse_spec
    from tasks.grid import expand_grid
    from tasks.tracking import open_campaign_run, open_trial_run, settle_finished_run

    spec = parse_spec({"campaign": {"name": "c"}, "model": {"name": "mlp"}, "training": {"steps": 20, "batch_size": 8, "lr": 0.1}})
    (trial,) = expand_grid(spec)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    parent = open_campaign_run(uri, "exp", "c", {}, 1)
    run_id = open_trial_run(uri, parent, "c", trial)
    result = {"checkpoint": "ckpt", "steps": 20, "metrics": {"val_loss": 0.25}}
    assert settle_finished_run(uri, parent, trial.id, result)
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["final.val_loss"] == "0.25"
    assert not settle_finished_run(uri, parent, trial.id, result)  # nothing left to do


def test_a_trial_opened_again_continues_its_run_and_one_deleted_by_hand_gets_a_new_one(tmp_path):
    """open_trial_run reads the campaign run's trial runs from the store once per process and
    keeps them: opened again (a retry, the next launch), a trial continues its run; a run
    deleted in MLflow's UI meanwhile is not written to, the trial gets a new one."""
    from mlflow import MlflowClient

    from tasks import tracking
    from tasks.grid import expand_grid
    from tasks.tracking import open_campaign_run, open_trial_run
    from training.spec import parse_spec

    spec = parse_spec({"campaign": {"name": "c"}, "model": {"name": "mlp"}, "training": {"steps": 20, "batch_size": 8, "lr": 0.1},
                       "grid": {"training.lr": [0.1, 0.2]}})
    first, second = expand_grid(spec)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    parent = open_campaign_run(uri, "exp", "c", {}, 2)
    run_id = open_trial_run(uri, parent, "c", first)
    assert open_trial_run(uri, parent, "c", first) == run_id
    other = open_trial_run(uri, parent, "c", second)
    tracking._trial_runs.clear()  # a later launch: what the store holds
    assert open_trial_run(uri, parent, "c", first) == run_id and open_trial_run(uri, parent, "c", second) == other
    MlflowClient(uri).delete_run(run_id)
    again = open_trial_run(uri, parent, "c", first)
    assert again not in (run_id, other) and MlflowClient(uri).get_run(again).data.tags[tracking.TRIAL_TAG] == first.id
    tracking._trial_runs.clear()
    assert open_trial_run(uri, parent, "c", first) == again


def test_a_trial_staged_before_anything_says_when_it_starts_is_scheduled_until_it_does(tmp_path):
    """Its run says SCHEDULED (new, or an earlier launch's), then RUNNING once it starts."""
    from mlflow import MlflowClient

    from tasks import tracking
    from tasks.grid import expand_grid
    from tasks.tracking import mark_running, open_campaign_run, open_trial_run
    from training.spec import parse_spec

    spec = parse_spec({"campaign": {"name": "c"}, "model": {"name": "mlp"}, "training": {"steps": 20, "batch_size": 8, "lr": 0.1},
                       "grid": {"training.lr": [0.1, 0.2]}})
    first, second = expand_grid(spec)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    parent = open_campaign_run(uri, "exp", "c", {}, 2)
    staged = open_trial_run(uri, parent, "c", first, scheduled=True)
    assert client.get_run(staged).info.status == "SCHEDULED"
    assert client.get_run(open_trial_run(uri, parent, "c", second)).info.status == "RUNNING"
    mark_running(uri, staged)
    assert client.get_run(staged).info.status == "RUNNING"
    tracking._trial_runs.clear()  # a later launch stages it again: its run, SCHEDULED again
    assert open_trial_run(uri, parent, "c", first, scheduled=True) == staged and client.get_run(staged).info.status == "SCHEDULED"


@pytest.mark.slow
def test_sigterm_stops_the_trials_and_leaves_true_records(tmp_path, digits_npz):
    import signal

    from cluster.leases import LeaseStore
    from tasks.records import campaign_status

    proc, root = start_campaign(tmp_path, digits_npz, "term")
    config = next(root.glob("*/trial.json"))
    family = descendants(proc.pid)
    assert len(family) >= 4  # Prefect's server, torchrun, two workers (and their metric sinks)
    assert all(address_is_loopback(a) for a in listening_addresses(family)), listening_addresses(family)
    assert LeaseStore().leases()
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=90)[0]
    assert proc.returncode == 143, output[-3000:]
    assert "stopped by SIGTERM" in output
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(config).encode() in _cmdline(p)]
    assert not alive, "a trial process outlived its campaign"
    assert LeaseStore().leases() == []
    assert [t.state for t in campaign_status(root.parent, "term")] == ["stopped"]
    assert mlflow_statuses(tmp_path) == ["KILLED", "KILLED"]  # the campaign's run and its trial's
    wait_until(lambda: not [p for p in family if process_alive(p)], 30, "a process of the campaign outlived it")


@pytest.mark.slow
def test_sigkill_leaves_nothing_running_and_records_that_say_so(tmp_path, digits_npz):
    import signal

    from tasks.records import campaign_status

    proc, root = start_campaign(tmp_path, digits_npz, "nine")
    family = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # no cleanup in the process itself: the warden's job
    proc.communicate(timeout=30)
    # The trial, Prefect's API server, everything it started ends; the records say interrupted.
    wait_until(lambda: not [p for p in family if process_alive(p)], 60, "a process of the killed campaign lives on")
    wait_until(lambda: [t.state for t in campaign_status(root.parent, "nine")] == ["interrupted"], 10, "not interrupted")
    wait_until(lambda: mlflow_statuses(tmp_path) == ["KILLED", "KILLED"], 60, "MLflow runs left RUNNING")


def test_a_record_whose_campaign_died_reads_interrupted(tmp_path):
    import subprocess
    import sys

    from tasks.records import TrialRecord, process_identity, read_trial_record, record_state, update_record

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    owner = process_identity(gone.pid)
    gone.wait()
    write_json_atomic(tmp_path / "record.json", {"state": "running", "owner": owner})  # as versions before records had one wrote it
    assert record_state(read_trial_record(tmp_path)) == "interrupted"
    record = update_record(tmp_path, state="running")  # this process: alive
    assert record_state(record) == "running"
    assert record_state(TrialRecord(state="finished", owner=owner)) == "finished"


def wait_until(condition, timeout_s: float, message: str) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, message
        time.sleep(0.2)


def descendants(pid: int) -> list[int]:
    """Every process below pid, by parent links (sessions of their own included)."""
    parents = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def process_alive(pid: int) -> bool:
    from cluster.leases import process_alive as alive

    return alive(pid, None)


def listening_addresses(pids: list[int]) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of TCP sockets these processes listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in (Path("/proc") / str(pid) / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    addresses = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addresses.append(fields[1].split(":")[0])
    return addresses


def address_is_loopback(hex_address: str) -> bool:
    if len(hex_address) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return hex_address.endswith("7F")
    return hex_address in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F") or (
        hex_address.startswith("0000000000000000FFFF0000") and hex_address.endswith("7F"))


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
def test_two_campaigns_on_one_device_take_turns(tmp_path, digits_npz):
    """Each campaign has three short trials for the one slot. Neither may run all three while
    the other waits: when a trial ends, the waiting campaign goes next."""
    import subprocess
    import sys

    import yaml

    from cluster.inventory import discover
    from cluster.leases import LeaseStore

    (slot,) = discover(cpu_slots=1).devices
    store = LeaseStore()
    procs = {}
    # Someone else holds the slot until both campaigns queue for it. The lease is renewed
    # (`hold`): a campaign slow to start (over a heartbeat timeout on a loaded host) would
    # otherwise find it expired, reclaim it and run before the other one queued.
    with store.hold("someone-else/x", {slot.id: slot.memory_bytes}, {slot.id: slot.memory_bytes}):
        for name in ("first", "second"):
            folder = tmp_path / name
            folder.mkdir()
            (folder / "params.yaml").write_text(yaml.safe_dump({
                "campaign": {"name": name}, "data": {"path": str(digits_npz)}, "model": {"name": "mlp", "width": 16},
                "training": {"steps": 60, "batch_size": 32, "lr": 0.05, "checkpoint_every": 60, "eval_every": 60},
                "grid": {"training.lr": [0.01, 0.02, 0.03]}, "resources": {"devices": 1}, "cluster": {"cpu_slots": 1},
                "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(tmp_path / "runs"), "summary": str(folder / "s.json")},
            }))
            procs[name] = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml"], cwd=folder,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            wait_until(lambda: name in store.waiting(), 180, f"campaign {name} never queued for the slot")
    outputs = {}
    for name, proc in procs.items():
        outputs[name] = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, outputs[name][-3000:]
    starts = sorted(
        (event["time"], name)
        for name in procs
        for event in map(json.loads, (tmp_path / "runs" / name / "allocations.jsonl").read_text().splitlines())
        if event["reason"] == "start"
    )
    assert [name for _, name in starts] == ["first", "second"] * 3, (  # turns, in the order they queued
        starts, {name: out[-2000:] for name, out in outputs.items()})


def test_a_kill_while_a_step_is_saved_again_leaves_that_step_to_resume_from(tmp_path, monkeypatch):
    """Saving a step that is saved already (a resize stopping on a checkpoint step) replaces
    it; a kill between taking the old one out of view and putting the new one in its place
    must leave a whole checkpoint of that step, not only the older ones (here: none)."""
    root = tmp_path / "checkpoints"
    saver = Checkpointer(root, keep=1, rank=0, world_size=1)
    saver.save(100, {"trainer": {"w": torch.full((4,), 1.0)}}, blocking=True)
    real_rename = Path.rename

    def killed_on_the_way_in(self, target):
        if self.name.startswith(".tmp-"):
            raise KeyboardInterrupt("killed")  # the process ends here
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", killed_on_the_way_in)
    with pytest.raises(KeyboardInterrupt):
        saver.save(100, {"trainer": {"w": torch.full((4,), 2.0)}}, blocking=True)
    monkeypatch.setattr(Path, "rename", real_rename)
    resumed = Checkpointer(root, keep=1, rank=0, world_size=1)
    resumed.clean_stale()
    state = {"trainer": {"w": torch.zeros(4)}}
    assert resumed.load_latest(state) == 100
    assert state["trainer"]["w"].tolist() == [1.0] * 4  # the old copy, whole (the new one never got in)
    assert [p.name for p in root.iterdir()] == ["step-00000100"]
    # and a save of the same step that is not interrupted leaves the new copy alone in view
    resumed.save(100, {"trainer": {"w": torch.full((4,), 3.0)}}, blocking=True)
    state = {"trainer": {"w": torch.zeros(4)}}
    assert Checkpointer(root, keep=1, rank=0, world_size=1).load_latest(state) == 100
    assert state["trainer"]["w"].tolist() == [3.0] * 4 and [p.name for p in root.iterdir()] == ["step-00000100"]
