"""One live run per campaign: a second `launch` (or `resume`) of a campaign whose run is alive
is refused before anything runs, exit 2, naming the run that holds it; a dead run's hold is
gone with it (a kernel lock)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import flows.run.owner as owner
from flows.run.owner import RECORD_NAME, CampaignBusy, claim_campaign, read_owner
from training.files import write_json_atomic

from conftest import REPO, campaign_cli, wait_for

HOLD = """
import sys
from pathlib import Path
from flows.run.owner import claim_campaign
claim_campaign(Path(sys.argv[1]), "c", "launch")
print("held", flush=True)
sys.stdin.read()
"""


def holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_is_refused_naming_the_first(tmp_path):
    first = holder(tmp_path / "c")
    try:
        with pytest.raises(CampaignBusy, match=rf"already running: `campaign launch` by .* pid {first.pid}, since") as refused:
            claim_campaign(tmp_path / "c", "c", "resume")
        assert "campaign status --watch" in str(refused.value)
    finally:
        first.stdin.close()
        first.wait(timeout=60)
    claim_campaign(tmp_path / "c", "c", "launch").release()  # its run ended in order: free again
    assert not (tmp_path / "c" / RECORD_NAME).exists()


def test_the_owner_lock_takes_its_mode_from_the_umask_so_a_group_sharing_the_runs_folder_can_take_it(tmp_path):
    before = os.umask(0o002)  # a runs folder shared by a group
    try:
        run = claim_campaign(tmp_path / "c", "c", "launch")
    finally:
        os.umask(before)
    try:
        assert (tmp_path / "c" / "owner.lock").stat().st_mode & 0o777 == 0o664  # the group's next run may open it
    finally:
        run.release()


def test_a_dead_runs_hold_is_taken_over(tmp_path):
    first = holder(tmp_path / "c")
    os.kill(first.pid, signal.SIGKILL)  # no cleanup: its record stays, naming a process that is gone
    first.wait()
    assert read_owner(tmp_path / "c").pid == first.pid
    ours = claim_campaign(tmp_path / "c", "c", "launch")
    try:
        assert read_owner(tmp_path / "c").pid == os.getpid()
    finally:
        ours.release()


class AnotherHost:
    """A run on another host of a shared folder whose file system carries no locks across
    hosts: only its record is seen here, renewed from a thread with that host's clock."""

    def __init__(self, folder: Path, skew_s: float = 0.0, host: str | None = None, boot: str = "another-boot"):
        self.folder, self.skew_s = folder, skew_s
        self.record = {"host": host or f"not-{socket.gethostname()}", "pid": 1, "user": "someone",
                       "since": time.time() + skew_s - 100, "renewed": time.time() + skew_s, "command": "launch", "boot": boot}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True)
        write_json_atomic(folder / RECORD_NAME, self.record)

    def _renew(self) -> None:
        while not self._stop.wait(0.05):
            write_json_atomic(self.folder / RECORD_NAME, self.record | {"renewed": time.time() + self.skew_s})

    def __enter__(self) -> "AnotherHost":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def quick_watch(monkeypatch):
    monkeypatch.setattr(owner, "OBSERVE_S", 1.0)
    monkeypatch.setattr(owner, "RENEW_S", 0.1)


@pytest.mark.parametrize("skew_s", [0.0, -3600.0, 3600.0], ids=["same clock", "clock an hour behind", "clock an hour ahead"])
def test_another_hosts_run_is_alive_while_its_record_is_renewed_whatever_its_clock(tmp_path, quick_watch, skew_s):
    """The record decides, judged by whether it is renewed while watched, not by comparing
    that host's clock with this one's: an hour of skew either way changes nothing."""
    folder = tmp_path / "c"
    folder.mkdir()
    with AnotherHost(folder, skew_s):
        with pytest.raises(CampaignBusy, match=f"on host not-{socket.gethostname()}, pid 1"):
            claim_campaign(folder, "c", "launch")
    # That run died (its record stays, renewed no more, however fresh its clock says it is).
    claim_campaign(folder, "c", "launch").release()
    assert not (folder / RECORD_NAME).exists()


def test_a_run_on_another_machine_with_this_hostname_is_told_by_its_boot_id(tmp_path, quick_watch):
    folder = tmp_path / "c"
    folder.mkdir()
    with AnotherHost(folder, host=socket.gethostname()):  # pid 1 is alive here too: it must not be judged by it
        with pytest.raises(CampaignBusy, match="pid 1"):
            claim_campaign(folder, "c", "launch")


def test_a_run_taken_over_by_another_host_stops_renewing_and_says_so(tmp_path, quick_watch):
    """This run stalled (not seen renewing) and a run on another host took the campaign over:
    the next renewal finds the record not its own, writes nothing, and calls on_lost."""
    folder = tmp_path / "c"
    taken = threading.Event()
    lost = []
    ours = claim_campaign(folder, "c", "launch", on_lost=lambda other: (lost.append(other), taken.set()))
    try:
        with AnotherHost(folder):
            assert taken.wait(10)
            assert lost[0].host == f"not-{socket.gethostname()}" and ours.lost == lost[0]
            time.sleep(0.3)  # three renew periods: ours would have been written again by now
            assert read_owner(folder).pid == 1
    finally:
        ours.release()
    assert read_owner(folder).pid == 1  # its end leaves the new owner's record alone


def write_params(folder: Path, digits: Path, steps: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "twice"}, "data": {"path": str(digits)}, "model": {"name": "mlp"},
        "training": {"steps": steps, "batch_size": 16, "lr": 0.05, "checkpoint_every": 50, "eval_every": 100000},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"), "summary": str(folder / "s.json")},
    }))


def launch(folder: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"], cwd=folder,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "300"})


def finished_lines(folder: Path) -> int:
    return sum(log.read_text().count("finished") for log in (folder / "runs" / "twice").glob("*/train.log"))


@pytest.mark.slow
def test_two_launches_at_once_one_runs_the_other_is_refused(tmp_path, digits_npz):
    write_params(tmp_path, digits_npz, steps=200)
    a, b = launch(tmp_path), launch(tmp_path)
    outputs = {p.pid: p.communicate(timeout=600) for p in (a, b)}
    codes = sorted([a.returncode, b.returncode])
    assert codes == [0, 2], outputs
    ran, refused = (a, b) if a.returncode == 0 else (b, a)
    message = outputs[refused.pid][1]
    assert "already running" in message and f"pid {ran.pid}" in message, message
    result = next((tmp_path / "runs" / "twice").glob("*/result.json"))
    assert result.exists()
    assert finished_lines(tmp_path) == 1, "the trial trained twice"


@pytest.mark.slow
def test_a_launch_while_the_campaign_trains_is_refused_and_status_works_beside_it(tmp_path, digits_npz):
    write_params(tmp_path, digits_npz, steps=100000)
    first = launch(tmp_path)
    try:
        wait_for(lambda: list((tmp_path / "runs" / "twice").glob("*/progress.json")) or first.poll() is not None, 300,
                 "the first run's trial to train")
        assert first.poll() is None, first.communicate()
        second = subprocess.run([sys.executable, "-m", "flows.cli", "resume", "params.yaml", "--no-live"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "300"})
        assert second.returncode == 2, second.stdout + second.stderr
        assert "already running" in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr
        status = campaign_cli("status", "twice", "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
        assert status.returncode == 0 and "running" in status.stdout, status.stdout + status.stderr
        assert first.poll() is None  # the refused run touched nothing of the live one
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    claim_campaign(tmp_path / "runs" / "twice", "twice", "launch").release()  # the first run's end freed the campaign
