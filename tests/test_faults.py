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

from flows.spec import SpecError, load_spec
from training.checkpoint import Checkpointer
from training.files import write_json_atomic
from training.manifest import MANIFEST, latest_valid_checkpoint, list_checkpoints, verify
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
    with pytest.raises(SpecError, match="a campaign spec is at most"):
        load_spec(huge)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SpecError, match="not a text file"):
        load_spec(binary)
    with pytest.raises(SpecError, match="not a text file"):
        load_spec(tmp_path)


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
    from tasks.records import update_record, write_campaign

    runs = tmp_path / "runs"
    write_campaign(runs, "broken", {"name": "broken", "trials": [{"id": "t1", "label": "x", "steps": 20, "devices": [1, 1]}]})
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
    from flows.live import LeaseHeartbeat

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
    assert not trial_module._group_alive(pgid)  # gone before the caller may release the leases
    runner.join(timeout=10)
    assert codes == [-9]
    with pytest.raises(TrialFailed, match="the campaign is stopping"):  # a task's retry cannot start it again
        apply_launch(plan, cfg)
    accept_launches()


@pytest.mark.slow
def test_sigterm_stops_the_trials_and_releases_their_devices(tmp_path, digits_npz):
    import signal
    import subprocess
    import sys

    import yaml

    from cluster.leases import LeaseStore

    runs = tmp_path / "runs"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "term"}, "data": {"path": str(digits_npz)}, "model": {"name": "small_cnn", "width": 8},
        "training": {"steps": 100000, "batch_size": 32, "lr": 0.05, "checkpoint_every": 200, "eval_every": 100000},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(runs), "summary": str(tmp_path / "s.json")},
    }))
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not list(runs.glob("term/*/progress.json")):  # the trial is training
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:] if proc.poll() is not None else "slow"
        time.sleep(0.2)
    config = next(runs.glob("term/*/trial.json"))
    assert LeaseStore().leases()
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=90)[0]
    assert proc.returncode == 143, output[-3000:]
    assert "stopped by SIGTERM" in output
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(config).encode() in _cmdline(p)]
    assert not alive, "a trial process outlived its campaign"
    assert LeaseStore().leases() == []


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
