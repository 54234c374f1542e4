"""One lease store per host, whoever runs: two Unix users (and two HOMEs) lease from the same
file, neither can take the other's device, and a user who cannot reach the store is refused
(exit 2) instead of getting a private one. The tests run as root and drop to other uids."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cluster.leases import DB_ENV, HOST_DIR_ENV, LeaseStore, LeaseStoreError

from conftest import REPO, as_uid, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="switching to other Unix users needs root and setpriv")

USERS = (61001, 61002)  # uids with no name, as a container's users may be


@pytest.fixture
def public_tmp():
    """A folder every uid can reach and write, as /var/tmp (pytest's tmp_path is private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="campaign-host-store-"))
    folder.chmod(0o1777)  # as /var/tmp is
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def as_user(uid: int, code: str, env: dict[str, str], **kwargs) -> subprocess.Popen:
    """`code` run by python as `uid`, with a HOME of its own."""
    home = Path(env["PUBLIC"]) / f"home-{uid}"
    home.mkdir(exist_ok=True)
    os.chown(home, uid, uid)
    full = {k: v for k, v in os.environ.items() if k != DB_ENV} | env | {"HOME": str(home), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([*as_uid(uid), sys.executable, "-c", code], env=full, cwd=home,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


HOLD = """
import json, sys
from cluster.leases import LeaseStore
store = LeaseStore()
cap = {"d0": 10, "d1": 10}
print(json.dumps({"path": str(store.path), "d0": store.acquire(sys.argv[0] + "hold/t@1", {"d0": 10}, cap)}), flush=True)
sys.stdin.read()  # held until the test closes our stdin
"""

TRY = """
import json
from cluster.leases import LeaseStore
store = LeaseStore()
cap = {"d0": 10, "d1": 10}
print(json.dumps({"path": str(store.path), "d0": store.acquire("try/t@1", {"d0": 10}, cap),
                  "d1": store.acquire("try/u@1", {"d1": 10}, cap)}))
"""


def test_two_users_with_their_own_homes_share_one_store(public_tmp):
    host = public_tmp / "host"  # not made yet: the first user makes it, shared
    env = {"PUBLIC": str(public_tmp), HOST_DIR_ENV: str(host)}
    holder = as_user(USERS[0], HOLD, env)
    try:
        held = json.loads(holder.stdout.readline() or "{}")
        assert held.get("d0") is True, holder.stderr.read()
        other = as_user(USERS[1], TRY, env)
        out, errors = other.communicate(timeout=120)
        assert other.returncode == 0, errors
        tried = json.loads(out)
        assert tried["path"] == held["path"] == str(host / "leases.db")  # the same file whatever the HOME
        assert tried == {"path": held["path"], "d0": False, "d1": True}  # the other user's device is not to be had
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert stat.S_IMODE(host.stat().st_mode) == 0o1777  # like /tmp: no user removes another's file
    assert {"leases.db", "leases.db.lock"} <= {p.name for p in host.iterdir()}
    for path in host.iterdir():  # SQLite's -wal and -shm too, while a connection keeps them
        assert stat.S_IMODE(path.stat().st_mode) == 0o666, path.name


def test_a_user_who_cannot_write_the_store_is_refused_not_given_a_private_one(public_tmp, tmp_path):
    host = public_tmp / "host"
    host.mkdir(mode=0o755)  # made by root for root alone
    env = {"PUBLIC": str(public_tmp), HOST_DIR_ENV: str(host)}
    probe = as_user(USERS[0], "from cluster.leases import LeaseStore; LeaseStore().leases()", env)
    _, errors = probe.communicate(timeout=120)
    assert probe.returncode != 0 and "LeaseStoreError" in errors and str(host) in errors, errors
    assert "chmod 1777" in errors  # the fix, named
    assert list(host.iterdir()) == []  # nothing half-made

    params = public_tmp / "params.yaml"
    params.write_text(json.dumps({"campaign": {"name": "refused"}, "model": {"name": "mlp"}, "training": {"steps": 2, "batch_size": 8, "lr": 0.1},
                                  "tracking": {"runs_dir": str(public_tmp / "runs"), "mlflow_uri": f"sqlite:///{public_tmp}/m.db",
                                               "summary": str(public_tmp / "s.json")}}))
    full = {k: v for k, v in os.environ.items() if k != DB_ENV} | env | {"HOME": str(public_tmp / f"home-{USERS[0]}"),
                                                                          "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    done = subprocess.run([*as_uid(USERS[0]), sys.executable, "-m", "flows.cli", "launch", str(params), "--no-live"], env=full,
                          cwd=public_tmp, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "lease store" in done.stderr and str(host) in done.stderr, done.stderr
    assert not (public_tmp / "runs").exists()  # refused before anything of the campaign was made


def test_a_store_moved_elsewhere_is_left_as_its_user_made_it(tmp_path, monkeypatch):
    monkeypatch.setenv(DB_ENV, str(tmp_path / "mine" / "leases.db"))
    LeaseStore().leases()
    assert not stat.S_IMODE((tmp_path / "mine").stat().st_mode) & 0o002  # a private path is not opened to others


def test_a_link_in_place_of_the_store_folder_is_refused(public_tmp, monkeypatch):
    (public_tmp / "elsewhere").mkdir()
    (public_tmp / "host").symlink_to(public_tmp / "elsewhere")
    monkeypatch.delenv(DB_ENV)
    monkeypatch.setenv(HOST_DIR_ENV, str(public_tmp / "host"))
    with pytest.raises(LeaseStoreError, match="not a folder"):
        LeaseStore().leases()
    assert list((public_tmp / "elsewhere").iterdir()) == []


@pytest.mark.slow
def test_two_users_campaigns_on_the_default_store_never_share_a_device(public_tmp, digits_npz):
    """Two Unix users, each with a HOME of their own, launch a campaign on the host's two CPU
    slots with the default store: the second waits for the first's devices. Every trainer
    process of both is sampled every 0.1 s; no sample finds both users' workers on one slot."""
    from test_fencing import WorkerSampler

    sampler = WorkerSampler({user: public_tmp / str(user) / "runs" for user in USERS})
    sampler.start()
    procs = {}
    try:
        first = USERS[0]
        procs[first] = launch_as(first, public_tmp, digits_npz)
        wait_for(lambda: sampler.running(first) or procs[first].poll() is not None, 300, "the first user's workers")
        assert procs[first].poll() is None, output(public_tmp, first)
        second = USERS[1]
        procs[second] = launch_as(second, public_tmp, digits_npz)
        for user, proc in procs.items():
            assert proc.wait(timeout=900) == 0, output(public_tmp, user)
    finally:
        sampler.stop.set()
        sampler.join()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert sampler.saw(USERS[0]) and sampler.saw(USERS[1])
    assert sampler.overlaps == [], sampler.overlaps[:5]
    assert max(sampler.gaps) < 1.0, max(sampler.gaps)  # sampled densely throughout (0.1 s asked)


def launch_as(uid: int, public: Path, digits: Path) -> subprocess.Popen:
    folder = public / str(uid)
    home = folder / "home"
    home.mkdir(parents=True)
    (folder / "params.yaml").write_text(json.dumps({
        "campaign": {"name": "shared-box"}, "data": {"path": str(digits)}, "model": {"name": "small_cnn", "width": 4},
        "training": {"steps": 400, "batch_size": 16, "lr": 0.05, "checkpoint_every": 100, "eval_every": 100000},
        "resources": {"devices": 2}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"), "summary": str(folder / "s.json")},
    }))
    subprocess.run(["chown", "-R", f"{uid}:{uid}", str(folder)], check=True)
    own = {name: str(home / name.lower()) for name in ("CAMPAIGN_CHECKPOINT_KEY", "CAMPAIGN_CHECK_CACHE", "CAMPAIGN_CACHE_DIR")}
    env = {k: v for k, v in os.environ.items() if k not in (DB_ENV, HOST_DIR_ENV)} | own | {
        "HOME": str(home), "PYTHONPATH": str(REPO), "COLUMNS": "200"}  # the default store, whatever the HOME
    log = open(folder / "out.log", "w")
    return subprocess.Popen([*as_uid(uid), sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"],
                            cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)


def output(public: Path, uid: int) -> str:
    return (public / str(uid) / "out.log").read_text()[-4000:]


def test_a_private_temp_folder_sweeps_those_its_prefix_left_by_processes_gone(tmp_path, monkeypatch):
    import subprocess
    import sys
    import tempfile

    from training.files import private_temp_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    left = tmp_path / f"campaign-test-{gone.stdout.strip()}-abc"  # a killed process's folder, its socket inside
    left.mkdir()
    (left / "sink").write_text("")
    alive = tmp_path / f"campaign-test-{os.getpid()}-def"  # a running process's (this one's)
    alive.mkdir()
    other = tmp_path / "campaign-testing-1-x"  # another prefix's
    other.mkdir()
    made = private_temp_dir("campaign-test-")
    assert made.name.startswith(f"campaign-test-{os.getpid()}-") and made.stat().st_mode & 0o777 == 0o700
    assert not left.exists() and alive.exists() and other.exists()
