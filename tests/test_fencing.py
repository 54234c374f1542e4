"""Fencing: a stalled holder's workers stop by themselves before its devices change hands.

Campaign A trains on both CPU slots; campaign B waits for them on the same lease file.
A's campaign process is stopped (SIGSTOP, as a debugger or a frozen VM would) for twice
the heartbeat timeout: B takes the devices once A's renew deadline and the store's safety
margin have passed. Both campaigns' worker processes are sampled every 0.1 s the whole
time; at no sample may two campaigns' workers be on one device. Every wait is for an
event (a file, a process, a line), bounded by a timeout.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from flows.run.campaign import HOLD_ENV
from training.files import read_json
from training.layout import campaign_files, trial_files

from conftest import running_state, stall_outside_a_lease_transaction, trainer_rank, wait_for

pytestmark = pytest.mark.slow  # two real campaigns, torchrun trials

# The lease heartbeat timeout of both campaigns (heartbeat every 2.5 s, margin 2.5 s): long
# enough that a campaign slowed by a loaded host (CI) still renews in time while it runs.
TIMEOUT_S = 10.0
SAMPLE_S = 0.1


class WorkerSampler(threading.Thread):
    """Which campaign's training workers run on which CPU slot, sampled every SAMPLE_S."""

    def __init__(self, runs: dict[str, Path]):
        super().__init__(daemon=True)
        self.runs = {name: str(path).encode() for name, path in runs.items()}
        self.samples: list[tuple[float, dict[str, set[str]]]] = []
        self.overlaps: list[tuple[float, dict[str, set[str]]]] = []
        self.gaps: list[float] = []  # time between consecutive samples
        self.stop = threading.Event()

    def run(self) -> None:
        last = None
        while not self.stop.is_set():
            now = time.monotonic()
            on = self.sample()
            self.samples.append((now, on))
            if any(len(names) > 1 for names in on.values()):
                self.overlaps.append((now, on))
            if last is not None:
                self.gaps.append(now - last)
            last = now
            self.stop.wait(max(0.0, SAMPLE_S - (time.monotonic() - now)))

    def sample(self) -> dict[str, set[str]]:
        on: dict[str, set[str]] = defaultdict(set)
        for name, core in self.workers().values():
            on[core].add(name)
        return dict(on)

    def workers(self) -> dict[int, tuple[str, str]]:
        """Each training worker of this test that may still run code: pid -> (campaign, CPU slot)."""
        found = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                rank = trainer_rank(int(proc.name))
                if rank is None:
                    continue  # torchrun's own process and the zygote hold no device; its workers do
                cmdline = (proc / "cmdline").read_bytes()
                name = next((n for n, root in self.runs.items() if root in cmdline), None)
                if name is None or running_state(int(proc.name)) is None:
                    continue  # not this test's, gone, or being killed (it runs no more code of its own)
                env = dict(item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
                cores = env[b"CAMPAIGN_CPU_CORES"].split(b",")
                found[int(proc.name)] = (name, cores[rank].decode())
            except (OSError, KeyError, IndexError, ValueError):
                continue  # gone while read, or not (yet) a worker of a trial
        return found

    def saw(self, name: str) -> bool:
        return any(name in names for _, on in self.samples for names in on.values())

    def running(self, name: str) -> bool:
        return bool(self.samples) and any(name in names for names in self.samples[-1][1].values())

    def pids(self, name: str) -> set[int]:
        """The campaign's worker processes running now (a fresh scan, not the last sample)."""
        return {pid for pid, (campaign, _) in self.workers().items() if campaign == name}


def start_campaign(folder: Path, name: str, digits: Path, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    folder.mkdir()
    (folder / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": name}, "data": {"path": str(digits)}, "model": {"name": "small_cnn", "width": 4},
        "training": {"steps": 100000, "batch_size": 16, "lr": 0.05, "checkpoint_every": 100, "eval_every": 100000},
        "resources": {"devices": 2}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"),
                     "summary": str(folder / "s.json")},
    }))
    out = open(folder / "out.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"], cwd=folder,
                            stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, folder / "out.log"


def hold_trials(campaign: Path) -> None:
    """Every trial of the campaign waits at its hold step (and each control step after it)
    while its `hold` file is there: its workers stay up, its fence still watches the lease,
    and it does not spend the test's CPU training steps nobody looks at."""
    record = wait_for(lambda: read_json(campaign_files(campaign).record), 240, f"{campaign.name}'s record")
    for trial in record["trials"]:
        (campaign / trial["id"]).mkdir(parents=True, exist_ok=True)
        trial_files(campaign / trial["id"]).hold.touch()


def last_renewal(lease_db: Path, pid: int) -> float:
    """When the leases the campaign process `pid` holds were last renewed (wall clock)."""
    conn = sqlite3.connect(lease_db, timeout=30)
    try:
        (renewed_at,) = conn.execute("SELECT max(heartbeat_at) FROM leases WHERE pid = ?", (pid,)).fetchone()
    finally:
        conn.close()
    assert renewed_at is not None, f"no lease of process {pid} in the file"
    return renewed_at


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_stalled_holder_never_shares_its_devices(tmp_path, digits_npz):
    env = {**os.environ, "CAMPAIGN_LEASE_DB": str(tmp_path / "leases.db"), "CAMPAIGN_LEASE_TIMEOUT_S": str(TIMEOUT_S),
           HOLD_ENV: "20"}
    sampler = WorkerSampler({"a": tmp_path / "a" / "runs", "b": tmp_path / "b" / "runs"})
    sampler.start()
    a, a_out = start_campaign(tmp_path / "a", "holder", digits_npz, env)
    b = None
    try:
        hold_trials(tmp_path / "a" / "runs" / "holder")
        wait_for(lambda: sampler.running("a") or a.poll() is not None, 240, "campaign A's workers")
        assert a.poll() is None, a_out.read_text()[-4000:]
        b, b_out = start_campaign(tmp_path / "b", "taker", digits_npz, env)
        # B's loop runs and finds every device leased: it waits its turn.
        wait_for(lambda: (tmp_path / "b" / "runs" / "taker" / "campaign.json").exists() or b.poll() is not None, 240,
                 "campaign B's loop")
        hold_trials(tmp_path / "b" / "runs" / "taker")
        assert b.poll() is None and not sampler.saw("b"), b_out.read_text()[-4000:]

        a_workers = wait_for(lambda: sampler.pids("a"), 60, "A's workers in one sample")
        stall_outside_a_lease_transaction(a.pid, tmp_path / "leases.db")  # A's campaign process stalls; its trial's do not
        stalled_at = time.monotonic()
        try:
            # A's last renewal, read once A can renew no more: its workers' deadline counts from it.
            renewed_at = last_renewal(tmp_path / "leases.db", a.pid)
            wait_for(lambda: not any(running_state(pid) for pid in a_workers), 3 * TIMEOUT_S,
                     "A's workers to stop by themselves")
            assert time.time() - renewed_at > TIMEOUT_S / 2  # they stopped near the deadline, not at once
            wait_for(lambda: sampler.running("b") or b.poll() is not None, 120, "campaign B to train on the devices")
            assert b.poll() is None, b_out.read_text()[-4000:]
            wait_for(lambda: time.monotonic() - stalled_at >= 2 * TIMEOUT_S, 2 * TIMEOUT_S + 1, "2x the heartbeat timeout")
        finally:
            os.kill(a.pid, signal.SIGCONT)

        # A wakes up, learns its leases are gone, and waits: B keeps the devices.
        wait_for(lambda: "leases" in a_out.read_text() and ("were lost" in a_out.read_text() or "reclaimed" in a_out.read_text()),
                 120, "campaign A to see its leases lost")
        seen = len(sampler.samples)
        wait_for(lambda: len(sampler.samples) >= seen + 30, 60, "30 more samples after A resumed")
        assert a.poll() is None and b.poll() is None, (a_out.read_text()[-3000:], b_out.read_text()[-3000:])
    finally:
        sampler.stop.set()
        sampler.join()
        for proc in (a, b):
            if proc is not None:
                stop(proc)

    assert sampler.overlaps == [], sampler.overlaps[:5]
    assert sampler.saw("a") and sampler.saw("b")
    assert max(sampler.gaps) < 1.0, max(sampler.gaps)  # sampled densely throughout (SAMPLE_S = 0.1 s asked)
    a_log = next((tmp_path / "a" / "runs" / "holder").glob("*/train.log")).read_text()
    assert "fenced:" in a_log, a_log[-3000:]  # A's workers stopped themselves: nothing else stopped them
