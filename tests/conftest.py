"""Shared fixtures. Every test runs real parts: torchrun, Prefect, MLflow, DVC, SQLite."""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sqlite3
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# The same examples on every run: a property test that fails, fails for everyone, every
# time (a random search's rare find must not decide a CI run; HYPOTHESIS_PROFILE=explore searches anew).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

REPO = Path(__file__).resolve().parent.parent

# Before Prefect is imported anywhere: no analytics (no network), gloo on loopback.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
# A launch of a test starts a temporary Prefect server of its own, not a resident one that
# would outlive the test (tests/test_resident_server.py turns it on where it is the subject).
os.environ["CAMPAIGN_SERVER"] = "off"
# Nor does a resident server of a test import MLflow and torch ahead for launches that never come
# (tests/test_spares.py turns them on).
os.environ["CAMPAIGN_SPARES"] = "off"
# Tests never touch the host-wide lease store of real campaigns.
os.environ["CAMPAIGN_LEASE_DB"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"campaign-test-leases-{os.getpid()}.db")
os.environ["CAMPAIGN_CHECKPOINT_KEY"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"campaign-test-key-{os.getpid()}")
# Workloads that passed their check are remembered per test run, not in the user's cache.
os.environ["CAMPAIGN_CHECK_CACHE"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"campaign-test-checks-{os.getpid()}")
# The campaign's other caches (the empty MLflow store it copies) made once per test process.
os.environ["CAMPAIGN_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"campaign-test-cache-{os.getpid()}")


def _remove_this_processs_files() -> None:
    """The lease store, key and caches above are this test process's: gone with it (a run
    left four in the temporary folder per worker)."""
    import glob
    import shutil

    for name in ("CAMPAIGN_LEASE_DB", "CAMPAIGN_CHECKPOINT_KEY", "CAMPAIGN_CHECK_CACHE", "CAMPAIGN_CACHE_DIR"):
        for path in glob.glob(glob.escape(os.environ[name]) + "*"):  # the store's lock and journal files too
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)


atexit.register(_remove_this_processs_files)
# Subprocesses (torchrun, dvc) must find the venv's console scripts and this checkout.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


def campaign_cli(*args: str, cwd: Path | None = None):
    """The real `campaign` command in its own process (exit code, stdout, stderr).

    Not typer's in-process CliRunner: it swaps the streams, and Prefect, imported inside a
    command, would bind its log handlers to streams the runner closes afterwards.
    """
    import subprocess

    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200"})


def as_uid(uid: int) -> list[str]:
    """The command prefix that runs a command as another Unix user (`uid`, its own group, no
    others; the tests run as root). It keeps only CAP_DAC_READ_SEARCH, so that it can reach
    this interpreter under root's private home: it reads what any user may read there, and
    writes only where the uid itself may (access() and every write follow the uid alone)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search"]


def trainer_rank(pid: int) -> int | None:
    """The local rank of a trial's torchrun worker (`python -m training.train`, or forked from
    its launch's zygote, whose command line and /proc environ it shows, and whose name says its
    rank: training/launch.py); None for any other process (torchrun itself, the zygote). OSError
    if the process is gone."""
    from training.launch import worker_name

    proc = Path(f"/proc/{pid}")
    cmdline = (proc / "cmdline").read_bytes()
    if b"training.zygote" in cmdline:
        name = (proc / "comm").read_text().strip()
        prefix = worker_name("")
        return int(name[len(prefix):]) if name.startswith(prefix) else None
    if b"training.train" not in cmdline or b"training.launch" in cmdline:
        return None
    environ = dict(item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
    return int(environ.get(b"LOCAL_RANK", b"0"))


def running_state(pid: int) -> str | None:
    """The process's state letter while it may still run code of its own; None once it is
    gone, a zombie, or has a SIGKILL pending (sent, or a fatal signal's group exit: it may
    stay in view a moment while the kernel ends it). A fencing test counts None as stopped."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    state = fields["State"].split()[0]
    killed = (int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)) & (1 << (9 - 1))
    return None if killed or state in ("Z", "X") else state


def wait_for(check, timeout: float, what: str, every: float = 0.2):
    """`check()`'s first true value, polled until `timeout` seconds; fails naming `what`."""
    import time

    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def http_status(url: str, auth: str | None = None, body: dict | None = None, timeout: float = 30) -> int:
    """The HTTP status a GET (or, with `body`, a JSON POST) to `url` gets; `auth`: Prefect's
    basic auth string ("user:password"), sent as its Authorization header."""
    import base64
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"} if body is not None else {})
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="session")
def digits_npz(tmp_path_factory) -> Path:
    from training.data import prepare_digits

    return prepare_digits(tmp_path_factory.mktemp("data") / "digits.npz")


@pytest.fixture(autouse=True)
def fresh_process_state(tmp_path_factory):
    """Each test starts from what a new process has: no user module imported from another
    test's folder (two tests' `mylab` packages would shadow each other) and launches allowed
    (a campaign flow run in this process earlier may have stopped them)."""
    yield
    base = str(tmp_path_factory.getbasetemp())
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(base):
            del sys.modules[name]
    importlib.invalidate_caches()
    if trial := sys.modules.get("tasks.trial"):
        trial.accept_launches()
        trial._revoked.clear()


@pytest.fixture(autouse=True)
def shared_prefect_server_for_slow_tests(request):
    """The slow tests launch campaigns: they share their process's server. A run of the fast
    tests alone (`make test-fast`) starts none; a fast test that launches starts its own."""
    if request.node.get_closest_marker("slow"):
        request.getfixturevalue("prefect_server_for_campaigns")


@pytest.fixture(scope="session")
def prefect_database(tmp_path_factory, worker_id):
    """A Prefect database with every migration applied, made once per test run (the xdist
    workers share it) by the product's own template (flows/servers/prefect_template.py): a
    server started on a new database migrates it first, ~7 s of CPU and of wall time, and the
    suite starts some twenty servers. Put in this process's cache folder too, where the servers
    it starts find it. `prefect_database(folder)` puts a copy where a server with
    PREFECT_HOME=folder finds it (or at a path ending in .db)."""
    import shutil
    from unittest import mock

    from flows.servers.prefect_template import blocks_mark_file
    from flows.servers.prefect_template import template as migrated

    root = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    with mock.patch.dict(os.environ, {"CAMPAIGN_CACHE_DIR": str(root / "campaign-cache")}):
        template = migrated()
    own = Path(os.environ["CAMPAIGN_CACHE_DIR"]) / template.name
    if not own.exists():
        own.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(blocks_mark_file(template), blocks_mark_file(own))  # first, as template() writes them
        shutil.copyfile(template, own)

    def copy(where: Path) -> Path:
        path = where if where.suffix == ".db" else where / "prefect.db"
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, path)
        return path

    return copy


@pytest.fixture(scope="session")
def prefect_server_for_campaigns(tmp_path_factory, prefect_database):
    """One Prefect server per test process, for every `campaign launch` the tests start.

    A launch without PREFECT_API_URL boots a temporary server of its own (flows/servers/warmup.py):
    ~14 s of CPU each time (one launch test: 59.0 CPU-s with its own, 44.6 with this one),
    and on two cores the suite's time is its CPU. The server is the same one a launch would start (same command and settings,
    its own database), and it is marked as the launch's temporary one (CAMPAIGN_PREFECT_TEMPORARY),
    so a campaign records and prints what it would with its own. The launch's own server is
    still exercised: tests/test_warmup.py, tests/test_ui.py and tests/test_dvc.py (the
    `make campaign` path) take this one away.
    """
    if os.environ.get("PREFECT_API_URL"):  # the person running the tests chose a server
        yield os.environ["PREFECT_API_URL"]
        return
    from flows.servers.warmup import TEMPORARY_ENV, WarmUp

    database = prefect_database(tmp_path_factory.mktemp("prefect-server") / "prefect.db")
    warm = WarmUp(server_env={"PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{database}"})
    warm._wait_for_server()
    yield warm.api_url
    warm.stop()
    for name in ("PREFECT_API_URL", TEMPORARY_ENV):
        os.environ.pop(name, None)


@pytest.fixture(scope="session")
def prefect_backend(prefect_database):
    """Prefect's own test harness (a server on a temporary database) for the flows a test runs
    in its own process; one per test process, started by the first test that needs it (each
    start costs ~25 s of CPU). Tests read back only their own flow runs, by id."""
    import tempfile
    from unittest import mock

    import prefect.testing.utilities as harness

    # Its database a copy of the migrated one: the harness names its file in a new folder.
    folder = tempfile.mkdtemp(prefix="prefect-harness-")
    prefect_database(Path(folder) / "prefect-test.db")
    with mock.patch.object(harness, "mkdtemp", lambda: folder), harness.prefect_test_harness(server_startup_timeout=120):
        yield


def without_shared_prefect_server(monkeypatch) -> None:
    """For a test of a launch that starts its own Prefect server (the default)."""
    from flows.servers.warmup import TEMPORARY_ENV

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv(TEMPORARY_ENV, raising=False)


def pytest_collection_modifyitems(config, items):
    """The slow end-to-end tests first, then the fast ones; the slow tests that mostly wait
    (`waits`: the pool's nodes and heartbeats, ~0.35 of a core over their wall time) spread
    through the first three quarters of the slow ones, so that about one waits at any time
    beside the tests that compute.

    `make test` hands out tests one at a time (`--dist load --maxschedchunk 1`: each worker
    holds its running test and one more), so this order is the order tests start in across the
    workers: the fast tests fill the end, whatever worker frees up first. Every waiting test
    first, as before, ran them side by side at the start (the two cores half idle for minutes);
    handed out in contiguous shares (`--dist worksteal`), one worker started a 50 s test 13
    minutes in while the others had ended."""
    def kind(item) -> int:
        return 0 if item.get_closest_marker("waits") else 1 if item.get_closest_marker("slow") else 2

    items[:] = suite_order(items, kind)


def suite_order(items: list, kind) -> list:
    """`kind(item)`: 0 mostly waits, 1 slow, 2 fast. The slow ones (kind 1) in their collected
    order, a kind-0 item before every `step`-th of them (spread over three quarters of them),
    then the fast ones."""
    waiting = [i for i in items if kind(i) == 0]
    slow = [i for i in items if kind(i) == 1]
    fast = [i for i in items if kind(i) == 2]
    step = max(1, (len(slow) * 3 // 4) // max(len(waiting), 1))
    order: list = []
    for k, item in enumerate(slow):
        if k % step == 0 and waiting:
            order.append(waiting.pop(0))
        order.append(item)
    return order + waiting + fast


# `TEST_CPU_LOG=path make test`: one line per test with its CPU seconds (this process's and
# those of the processes it started and waited for), its wall seconds, its id, when it started
# and which worker ran it, to find where a run's CPU goes (on two cores the suite's time is its
# CPU, not its tests' wall times) and when a worker sat idle.
_CPU_LOG = os.environ.get("TEST_CPU_LOG")

if _CPU_LOG:
    import resource
    import time

    def _cpu_seconds() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        cpu, wall, started = _cpu_seconds(), time.perf_counter(), time.time()
        yield
        with open(_CPU_LOG, "a") as log:
            log.write(f"{_cpu_seconds() - cpu:.1f}\t{time.perf_counter() - wall:.1f}\t{item.nodeid}"
                      f"\t{started:.1f}\t{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\n")


def stall_outside_a_lease_transaction(pid: int, lease_db: Path) -> None:
    """SIGSTOP the lease holder `pid` (a campaign, a pool node's segment) at a moment it holds
    no write transaction on the lease file.

    Stopped inside one (a few ms per heartbeat; longer on a loaded host, and it once happened
    in CI), it keeps SQLite's write lock: every other campaign then waits, sharing nothing,
    until it resumes or dies (docs/guarantees.md says so). That is not what this test is about, so
    such a stop is undone and tried again."""
    for _ in range(200):
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"T", 10, "the stop", every=0.01)
        conn = sqlite3.connect(lease_db, timeout=0.5, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")  # the write lock: free unless the stopped process holds it
            conn.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:
            os.kill(pid, signal.SIGCONT)
            # Let it finish that transaction before the next stop: stopped again at once, it
            # could spend most of the retries stopped, and its leases expire before the test's stall.
            with sqlite3.connect(lease_db, timeout=30, isolation_level=None) as running:
                running.execute("BEGIN IMMEDIATE")
                running.execute("ROLLBACK")
            running.close()
        finally:
            conn.close()
    pytest.fail(f"process {pid} held the lease file's write lock at each of 200 stops")
