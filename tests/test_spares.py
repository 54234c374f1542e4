"""The resident server's spares (tasks/spares.py): a launch that reports to the folder's
resident server takes its MLflow hub and its warm workers' zygote with their imports done, and
its campaign's runs, metrics and pictures are all there; each is served by a copy of the spare,
which offers itself again for the next launch; the zygote's workers carry the launch's
marks where the warden and the trials' stop look for them; a spare of another environment or of
code that changed since it imported is not taken; the spares not taken end with the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_faults import wait_until
from test_tracking_hub import two_trials_whole
from training.process import process_running, process_table

REPO = Path(__file__).resolve().parent.parent


def offered(folder: Path, kind: str) -> int | None:
    """The pid in the spare's record, if it offers itself now."""
    from tasks.spares import state_path

    try:
        return json.loads(state_path(folder, kind).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def spare_pids(folder: Path) -> dict[str, int] | None:
    """The pid of each spare, once every one is ready and offers itself."""
    from tasks.spares import KINDS, ready

    pids = {kind: offered(folder, kind) for kind in KINDS}
    return pids if all(pid is not None and ready(folder, kind) == pid for kind, pid in pids.items()) else None


def copies(folder: Path, kind: str, spare: int) -> list[int]:
    """The running processes the folder's spare of `kind` (pid `spare`) forked to serve launches:
    its children that keep its command line (not yet their own children, which a fork to start
    a program shows with it for a moment)."""
    found = []
    for pid, (parent, _) in process_table().items():
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if parent == spare else []
        except OSError:
            continue
        if words[-4:-1] == [b"tasks.spares", kind.encode(), str(folder.resolve()).encode()]:
            found.append(pid)
    return found


def spares_ready(folder: Path) -> dict[str, int]:
    wait_until(lambda: spare_pids(folder) is not None, 120, "the resident server's spares were not ready")
    return spare_pids(folder)


@pytest.mark.slow
def test_a_launch_takes_the_servers_spares_and_its_runs_metrics_and_pictures_are_all_there(tmp_path, digits_npz, prefect_database):
    prefect_database(tmp_path / ".campaign" / "prefect")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "spared"}, "data": {"path": str(digits_npz)}, "model": {"name": "mlp", "width": 8},
        "training": {"steps": 6, "batch_size": 16, "lr": 0.05, "eval_every": 3, "checkpoint_every": 3, "log_every": 1},
        "grid": {"training.lr": [0.05, 0.1]}, "resources": {"devices": 1}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": uri, "experiment": "spared", "runs_dir": str(tmp_path / "runs"), "summary": str(tmp_path / "s.json")},
    }))
    env = {**os.environ, "CAMPAIGN_SERVER": "on", "CAMPAIGN_SPARES": "on", "CAMPAIGN_LEASE_DB": str(tmp_path / "leases.db"),
           "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    started = subprocess.run([sys.executable, "-c", "from pathlib import Path; from flows.servers.resident import Resident; "
                              "Resident(Path('.')).ready()"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert started.returncode == 0, started.stderr
    again: dict[str, int] = {}
    try:
        taken = spares_ready(tmp_path)  # made once the command that started the server has exited
        done = subprocess.run([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live", "--timings"], cwd=tmp_path,
                              env={**env, "COLUMNS": "300"}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        for kind in ("launch", "hub", "zygote"):
            assert f"the resident server's spare {kind} taken (its imports done)" in done.stdout, done.stdout
        assert "first training step" in done.stdout
        assert "finished 2/2 trials" in done.stdout  # the spare launch wrote to the command's own output

        two_trials_whole(uri, "spared")  # the trainers' metrics through the spare hub's socket among them
        # The copies that served it ended with the campaign; the spares offer themselves again, made once.
        wait_until(lambda: not any(copies(tmp_path, kind, pid) for kind, pid in taken.items()), 60,
                   "a process forked from a spare outlived the launch")
        again = spares_ready(tmp_path)
        assert again == taken
        again_done = subprocess.run([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live", "--timings"], cwd=tmp_path,
                                    env={**env, "COLUMNS": "300"}, capture_output=True, text=True, timeout=300)
        assert again_done.returncode == 0, again_done.stdout[-3000:] + again_done.stderr[-3000:]
        assert "the resident server's spare launch taken (its imports done)" in again_done.stdout  # at once: nothing made again
    finally:
        subprocess.run([sys.executable, "-m", "flows.cli", "stop-server"], cwd=tmp_path, env=env, capture_output=True, timeout=60)
    wait_until(lambda: not any(process_running(pid) for pid in again.values()), 60, "a spare outlived its server")  # (they die with it)
    assert not list((tmp_path / ".campaign").glob("spare-*"))


def test_a_spare_is_taken_only_in_its_environment_with_its_code_and_its_zygote_carries_the_launchs_marks(tmp_path, monkeypatch):
    from tasks import spares
    from tasks import trial

    (tmp_path / ".campaign").mkdir()
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv(spares.SPARES_ENV, "on")
    made = [spares.start(tmp_path, "zygote")]
    try:
        wait_until(lambda: spares.ready(tmp_path, "zygote") == made[0].pid, 120, "the spare zygote was not ready")
        spares.offered_by(tmp_path)
        monkeypatch.setenv("CAMPAIGN_SPARE_TEST", "another environment")
        assert not spares.adopt_zygote(tmp_path)
        assert spares.state_path(tmp_path, "zygote").exists() and made[0].poll() is None  # left for a launch in its own
        monkeypatch.delenv("CAMPAIGN_SPARE_TEST")
        with monkeypatch.context() as m:
            m.setattr(spares, "unchanged", lambda files: False)  # a file it imported changed since
            assert not spares.adopt_zygote(tmp_path)
        made[0].wait(timeout=30)  # a stale spare is ended (the server makes another)
        assert not spares.state_path(tmp_path, "zygote").exists()

        made.append(spares.start(tmp_path, "zygote"))
        wait_until(lambda: spares.ready(tmp_path, "zygote") == made[1].pid, 120, "the spare zygote was not ready")
        monkeypatch.setenv("CAMPAIGN_WARDEN_MARK", "0123456789abcdef")
        assert spares.adopt_zygote(tmp_path)
        zygote = trial._zygotes[(sys.executable, str(tmp_path))]
        served = zygote.proc.pid
        assert served != made[1].pid and made[1].poll() is None  # a copy of the spare serves the launch; the spare stays
        wait_until(lambda: offered(tmp_path, "zygote") == made[1].pid, 30, "the spare did not offer itself again")
        stdin_read, stdin_write = os.pipe()
        reply_read, reply_write = os.pipe()
        worker = zygote.fork("training.worker", ["--reply-fd", "{fd1}"], dict(os.environ), tmp_path, fds=[stdin_read, reply_write],
                             stdin=True, name="warm worker")
        os.close(stdin_read)
        os.close(reply_write)
        shown = Path(f"/proc/{worker.pid}/environ").read_bytes().split(b"\0")
        assert b"CAMPAIGN_WARDEN_MARK=0123456789abcdef" in shown
        assert f"{trial.TRIAL_MARK}={trial._trial_mark}".encode() in shown
        # The copy wrote the marks over its own pages: the spare keeps its placeholders for the next launch.
        assert f"CAMPAIGN_WARDEN_MARK={spares.PLACEHOLDER}".encode() in Path(f"/proc/{made[1].pid}/environ").read_bytes().split(b"\0")
        os.close(stdin_write)  # no trial: the worker exits
        assert worker.wait(timeout=60) == 0
        os.close(reply_read)
        trial.close_warm_workers()  # the zygote ends once its socket closes
        wait_until(lambda: not process_running(served), 60, "the zygote that served the launch outlived its socket")

        assert spares.adopt_zygote(tmp_path)  # the next launch's: served by another copy, the spare's imports done once
        assert trial._zygotes[(sys.executable, str(tmp_path))].proc.pid not in (served, made[1].pid)
    finally:
        spares.offered_by(None)
        trial.close_warm_workers()
        for proc in made:
            proc.kill()
            proc.wait()
    assert not process_running(made[1].pid)


def trained_since(runs: Path, since: float) -> bool:
    """Whether a trial of the campaigns in `runs` took a step after `since` (a time)."""
    from training.progress import read_progress

    return any((p := read_progress(d)) is not None and p.step > 0 and p.updated >= since for d in runs.glob("*/*") if d.is_dir())


@pytest.mark.slow
def test_the_spare_launch_is_the_command_its_exit_code_its_stop_and_its_death(tmp_path, digits_npz, prefect_database):
    """`campaign launch` runs in the spare launch (tasks/spares.py run_command): the command's
    exit code and error are the spare's; SIGTERM to the command stops the campaign as it would
    stop the command itself (exit 143); the command killed outright, the spare dies too."""
    prefect_database(tmp_path / ".campaign" / "prefect")
    spec = {
        "campaign": {"name": "long"}, "data": {"path": str(digits_npz)}, "model": {"name": "mlp", "width": 8},
        "training": {"steps": 100000, "batch_size": 16, "lr": 0.05, "eval_every": 100000, "checkpoint_every": 200},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "runs_dir": str(tmp_path / "runs"),
                     "summary": str(tmp_path / "s.json")},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**spec, "training": {**spec["training"], "stepz": 3}}))
    env = {**os.environ, "CAMPAIGN_SERVER": "on", "CAMPAIGN_SPARES": "on", "CAMPAIGN_LEASE_DB": str(tmp_path / "leases.db"),
           "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    launch = [sys.executable, "-m", "flows.cli", "launch", "--no-live"]
    started = subprocess.run([sys.executable, "-c", "from pathlib import Path; from flows.servers.resident import Resident; "
                              "Resident(Path('.')).ready()"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert started.returncode == 0, started.stderr
    spare = 0
    try:
        spare = spares_ready(tmp_path)["launch"]
        refused = subprocess.run([*launch, "bad.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "stepz" in refused.stderr, refused.stdout + refused.stderr
        assert "stepz" not in refused.stdout  # its error on the command's own stderr
        assert not copies(tmp_path, "launch", spare)  # the copy that ran the command ended with it

        assert spares_ready(tmp_path)["launch"] == spare  # the spare offers itself again
        since = time.time()
        proc = subprocess.Popen([*launch, "params.yaml"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_until(lambda: trained_since(tmp_path / "runs", since) or proc.poll() is not None, 240, "the trial's first step")
        running = copies(tmp_path, "launch", spare)
        assert len(running) == 1 and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
        assert proc.returncode == 143 and "stopped by SIGTERM" in output, output[-3000:]
        assert not process_running(running[0])  # the command ended when its process did

        assert spares_ready(tmp_path)["launch"] == spare
        since = time.time()
        proc = subprocess.Popen([*launch, "params.yaml"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: trained_since(tmp_path / "runs", since) or proc.poll() is not None, 240, "the trial's first step")
        running = copies(tmp_path, "launch", spare)
        assert len(running) == 1
        proc.kill()
        proc.wait()
        wait_until(lambda: not process_running(running[0]), 60, "the spare launch's copy outlived its command's process")
        assert process_running(spare)
    finally:
        for pid in copies(tmp_path, "launch", spare):
            os.kill(pid, signal.SIGKILL)
        subprocess.run([sys.executable, "-m", "flows.cli", "stop-server"], cwd=tmp_path, env=env, capture_output=True, timeout=60)


def test_a_spare_watches_the_projects_own_files_for_changes():
    """What a spare checks before it is taken (code_files) covers the project's modules, not
    only the site folders: a launch never takes a spare that imported code since edited."""
    from tasks import spares

    files = spares.code_files()
    for module in ("tasks/spares.py", "flows/cli.py", "flows/run/campaign.py", "training/zygote.py", "cluster/leases.py"):
        assert str(REPO / module) in files, module


def test_spares_are_made_while_a_launch_runs_only_where_the_host_has_cores_to_spare():
    from tasks.spares import KINDS, may_make

    assert may_make(False, 2, 7.5)  # nothing of the folder runs: whatever the load
    assert not may_make(True, 2, 0.0)  # a small host: its cores are the campaign's
    assert may_make(True, 16, 4.0)  # a GPU host whose trials leave most cores idle
    assert not may_make(True, 16, 16 - len(KINDS) - 0.5)  # the same host busy
