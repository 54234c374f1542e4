"""The host-wide lease store, with real processes and a real SQLite file."""

from __future__ import annotations

import contextlib

import json
import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.leases import (
    LeaseLost,
    close_kept_connections,
    LeaseStore,
    LeaseStoreBusy,
    LeaseStoreError,
    LeaseStoreRebuilt,
    LeaseUnavailable,
    process_alive,
    process_start,
)

CAP = {"d0": 10, "d1": 10, "d2": 10}


class Clock:
    """A clock the test moves by hand, shared by the stores of one test."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _wait_for(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# --- racing processes ---------------------------------------------------------------------

# (claims of process 0, claims of process 1, how many may win together)
SCENARIOS = [
    ({"d0": 10}, {"d0": 10}, 1),  # the same device, exclusively
    ({"d0": 6}, {"d0": 6}, 1),  # shares that do not fit together
    ({"d0": 5}, {"d0": 5}, 2),  # shares that do
    ({"d0": 10, "d1": 10}, {"d1": 10, "d2": 10}, 1),  # overlapping sets: all or nothing
]
ROUNDS = 100


def _race_worker(path: str, who: int, barrier, results) -> None:
    store = LeaseStore(path)
    for r in range(ROUNDS):
        claims = SCENARIOS[r % len(SCENARIOS)][who]
        barrier.wait()  # both ask at the same moment
        won = store.acquire(f"p{who}-r{r}", claims, CAP)
        barrier.wait()  # both have asked: what the file holds now is the round's outcome
        results.put((r, who, won, store.usage()))
        barrier.wait()  # both have looked before anyone lets go
        if won:
            store.release(f"p{who}-r{r}")


def test_racing_processes_never_get_overlapping_leases(tmp_path):
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    path = str(tmp_path / "leases.db")  # created by the race itself, on round 0
    workers = [ctx.Process(target=_race_worker, args=(path, who, barrier, results)) for who in (0, 1)]
    for w in workers:
        w.start()
    # A bound, not a wait: two spawned interpreters import and race under a loaded host (CI once took over 60 s).
    outcomes = [results.get(timeout=300) for _ in range(2 * ROUNDS)]
    for w in workers:
        w.join(timeout=30)
        assert w.exitcode == 0

    by_round: dict[int, list] = {}
    for r, who, won, usage in outcomes:
        by_round.setdefault(r, []).append((who, won, usage))
    for r, seen in by_round.items():
        claims0, claims1, winners = SCENARIOS[r % len(SCENARIOS)]
        won = [who for who, w, _ in seen if w]
        assert len(won) == winners, f"round {r}: winners {won}"
        expected: dict[str, int] = {}
        for who in won:
            for device, claim in (claims0, claims1)[who].items():
                expected[device] = expected.get(device, 0) + claim
        # Both processes see exactly the winners' claims: the loser wrote nothing.
        assert all(usage == expected for _, _, usage in seen), f"round {r}: {seen}"
        assert all(v <= CAP[d] for d, v in expected.items())


# --- dead holders ---------------------------------------------------------------------------

HOLDER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from cluster.leases import LeaseStore
    path, holder, device, heartbeat = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    store = LeaseStore(path, heartbeat_timeout_s=heartbeat * 20)
    with store.hold(holder, {device: 10}, {device: 10}, heartbeat_s=heartbeat) as lease:
        print("held", flush=True)
        sys.stdin.readline()  # until the test closes stdin (or kills us)
        print("lost" if lease.lost else "kept", flush=True)
    """
)


def _start_holder(path: Path, holder: str, device: str = "d0", heartbeat_s: float = 0.05) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, str(path), holder, device, str(heartbeat_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_holder_killed_with_sigkill_is_reclaimed_even_before_it_is_reaped(tmp_path):
    path = tmp_path / "leases.db"
    victim = _start_holder(path, "victim")
    store = LeaseStore(path)
    assert not store.acquire("other", {"d0": 10}, CAP)

    victim.send_signal(signal.SIGKILL)
    os.waitid(os.P_PID, victim.pid, os.WEXITED | os.WNOWAIT)  # dead, left a zombie
    reclaimed = store.reclaim()
    victim.wait()

    assert [(lease.holder, lease.device_id, lease.pid) for lease in reclaimed] == [
        ("victim", "d0", victim.pid)
    ]
    assert store.acquire("other", {"d0": 10}, CAP)


def test_heartbeat_expiry_reclaims_and_the_holder_learns_it(tmp_path):
    clock = Clock()
    store = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=10, clock=clock)
    assert store.acquire("a", {"d0": 4}, CAP)
    for _ in range(3):  # renewed in time, it outlives several timeouts
        clock.now += 9
        store.renew("a")
        assert store.reclaim() == []
    clock.now += 11  # past its renew deadline: its workers have stopped (training.fence), but the
    assert store.reclaim() == []  # rows are reclaimed only after the safety margin
    with pytest.raises(LeaseLost, match="renew deadline"):  # and the holder cannot renew them back
        store.renew("a")
    clock.now += store.reclaim_margin_s
    assert [lease.holder for lease in store.reclaim()] == ["a"]
    with pytest.raises(LeaseLost):
        store.renew("a")


def test_a_holder_is_judged_by_the_heartbeat_timeout_it_renews_by_not_by_the_judges(tmp_path):
    """Two campaigns with different timeouts (`CAMPAIGN_LEASE_TIMEOUT_S`) on one host: one that
    renews every 150 s (timeout 600 s) is alive 100 s after its last renewal, though that is
    past the other's 60 s; its devices are not given away until its own deadline and margin."""
    clock = Clock()
    patient = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=600, clock=clock)
    hasty = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=60, clock=clock)
    assert patient.acquire("x", {"d0": 10}, CAP)
    clock.now += 100  # past 60 + 15: the hasty store's own deadline and margin
    assert hasty.reclaim() == [] and not hasty.acquire("y", {"d0": 10}, CAP)
    patient.renew("x")  # in time by its own timeout
    clock.now += 600 + 150 + 1  # past its own deadline and margin: now it is dead to anyone
    assert [lease.holder for lease in hasty.reclaim()] == ["x"]
    assert hasty.acquire("y", {"d0": 10}, CAP)


def test_a_reused_pid_is_not_taken_for_the_holder():
    me = os.getpid()
    assert process_alive(me, process_start(me))
    assert not process_alive(me, process_start(me) + 1)  # same pid, another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid, None)


def test_a_lease_follows_the_given_pid(tmp_path):
    store = LeaseStore(tmp_path / "leases.db")
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    assert store.acquire("trial", {"d0": 10}, CAP, pid=child.pid)
    assert store.reclaim() == []
    child.communicate()  # the child exits; this process, which took the lease, lives on
    assert [lease.holder for lease in store.reclaim()] == ["trial"]
    with pytest.raises(ValueError, match="not a running process"):
        store.acquire("late", {"d0": 1}, CAP, pid=child.pid)


# --- claims --------------------------------------------------------------------------------


def test_all_or_nothing_and_shares_by_memory(tmp_path):
    store = LeaseStore(tmp_path / "leases.db")
    assert store.acquire("a", {"d1": 10}, CAP)
    assert not store.acquire("b", {"d0": 3, "d1": 1}, CAP)
    assert store.usage() == {"d1": 10}  # b's d0 was not written
    assert store.acquire("b", {"d0": 3}, CAP) and store.acquire("c", {"d0": 7}, CAP)
    assert not store.acquire("d", {"d0": 1}, CAP)
    store.release("c")
    assert store.acquire("d", {"d0": 7}, CAP)
    assert store.usage() == {"d0": 10, "d1": 10}


def test_a_holder_grows_and_releases_as_one(tmp_path):
    store = LeaseStore(tmp_path / "leases.db")
    assert store.acquire("t", {"d0": 4}, CAP)
    assert store.acquire("t", {"d0": 10, "d1": 2}, CAP)  # its own share does not block it
    assert store.usage() == {"d0": 10, "d1": 2}
    store.release("t")
    assert store.usage() == {}


def test_the_smallest_declared_capacity_wins(tmp_path):
    store = LeaseStore(tmp_path / "leases.db")
    assert store.acquire("small-view", {"d0": 40}, {"d0": 40})  # exclusive, as it sees d0
    assert not store.acquire("big-view", {"d0": 40}, {"d0": 80})


@pytest.mark.parametrize(
    "claims, match",
    [
        ({}, "claims no device"),
        ({"dx": 1}, "no capacity"),
        ({"d0": 11}, "not in 1..10"),
        ({"d0": 0}, "not in"),
    ],
)
def test_malformed_claims_are_refused(tmp_path, claims, match):
    with pytest.raises(ValueError, match=match):
        LeaseStore(tmp_path / "leases.db").acquire("t", claims, CAP)


def test_hold_renews_past_the_timeout_then_releases(tmp_path):
    store = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=0.6)
    with store.hold("t", {"d0": 10}, CAP, heartbeat_s=0.05) as lease:
        time.sleep(1.2)  # two timeouts: only the heartbeat keeps it
        assert [lease.holder for lease in LeaseStore(store.path, heartbeat_timeout_s=0.6).leases()] == ["t"]
        with pytest.raises(LeaseUnavailable), store.hold("u", {"d0": 1}, CAP):
            pass
        assert not lease.lost
    assert store.usage() == {}


def test_hold_reports_a_lost_lease(tmp_path):
    store = LeaseStore(tmp_path / "leases.db")
    with store.hold("t", {"d0": 10}, CAP, heartbeat_s=0.02) as lease:
        # Another campaign whose clock says the heartbeat is long overdue reclaims it.
        LeaseStore(store.path, clock=lambda: time.time() + 3600).reclaim()
        _wait_for(lambda: lease.lost, what="the heartbeat to notice")
        with pytest.raises(LeaseLost):
            lease.check()


# --- the file ------------------------------------------------------------------------------


def test_garbage_file_is_moved_aside_and_rebuilt(tmp_path):
    path = tmp_path / "leases.db"
    garbage = os.urandom(8192)
    path.write_bytes(garbage)
    clock = Clock()
    store = LeaseStore(path, heartbeat_timeout_s=30, clock=clock)
    with pytest.warns(LeaseStoreRebuilt, match="corrupt"):
        assert store.usage() == {}
    [aside] = tmp_path.glob("leases.db.corrupt-*")
    assert aside.read_bytes() == garbage  # kept for inspection, never deleted
    assert not store.acquire("new", {"d0": 1}, CAP)  # live holders get a timeout to re-register
    clock.now += 31
    assert store.acquire("new", {"d0": 1}, CAP)


def test_a_process_stopped_holding_the_lock_file_makes_others_wait_only_the_busy_timeout(tmp_path, monkeypatch):
    """A process stopped in the middle of a lease change (SIGSTOP, a debugger) keeps its lock on
    the file's lock: a transaction waits for it only the busy timeout, then says so; so does a
    rebuild, which needs the lock alone, while a stopped process holds it shared."""
    import fcntl

    monkeypatch.setenv("CAMPAIGN_LEASE_BUSY_S", "0.2")
    path = tmp_path / "leases.db"
    store = LeaseStore(path, heartbeat_timeout_s=30)
    assert store.acquire("a", {"d0": 1}, CAP)
    lock = os.open(f"{path}.lock", os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # stopped in the middle of a rebuild
        with pytest.raises(LeaseStoreBusy, match="stayed held by another process"):
            store.acquire("b", {"d1": 1}, CAP)
        fcntl.flock(lock, fcntl.LOCK_SH)  # stopped in the middle of a transaction
        path.write_bytes(os.urandom(8192))  # and the file needs a rebuild
        with pytest.raises(LeaseStoreBusy, match="stayed held by another process"):
            LeaseStore(path, heartbeat_timeout_s=30).usage()
    finally:
        os.close(lock)
    with pytest.warns(LeaseStoreRebuilt):  # once it is let go, the rebuild goes through
        assert LeaseStore(path, heartbeat_timeout_s=30).usage() == {}


def test_a_tampered_row_is_not_trusted(tmp_path):
    path = tmp_path / "leases.db"
    assert LeaseStore(path).acquire("t", {"d0": 4}, CAP)
    with sqlite3.connect(path) as conn:  # valid SQLite, wrong content: d0 looks free
        conn.execute("UPDATE leases SET memory_bytes = 1")
    with pytest.warns(LeaseStoreRebuilt, match="checksum"):
        assert LeaseStore(path).usage() == {}


def test_live_holder_re_registers_after_a_rebuild(tmp_path):
    path = tmp_path / "leases.db"
    holder = _start_holder(path, "survivor", heartbeat_s=0.05)
    try:
        path.write_bytes(os.urandom(4096))
        store = LeaseStore(path, heartbeat_timeout_s=2.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LeaseStoreRebuilt)  # whoever notices first rebuilds
            assert not store.acquire("intruder", {"d0": 10}, CAP)
            _wait_for(
                lambda: [lease.holder for lease in store.leases()] == ["survivor"], what="re-registration"
            )
        time.sleep(2.2)  # past the grace period the holder still has it: it is alive
        assert not store.acquire("intruder", {"d0": 10}, CAP)
    finally:
        out, _ = holder.communicate("\n", timeout=30)
    assert out.strip() == "kept"
    assert store.usage() == {}


def test_a_holder_whose_device_was_taken_after_a_rebuild_loses_it(tmp_path):
    path, clock = tmp_path / "leases.db", Clock()
    old = LeaseStore(path, heartbeat_timeout_s=10, clock=clock)
    assert old.acquire("slow", {"d0": 10}, CAP)
    path.write_bytes(os.urandom(4096))
    new = LeaseStore(path, heartbeat_timeout_s=10, clock=clock)
    with pytest.warns(LeaseStoreRebuilt):
        new.reclaim()
    clock.now += 11  # "slow" missed the whole grace period
    assert new.acquire("fast", {"d0": 10}, CAP)
    with pytest.raises(LeaseLost, match="rebuilt"):
        old.renew("slow")
    assert [lease.holder for lease in new.leases()] == ["fast"]


def test_a_store_deleted_while_in_use_is_made_again_with_a_grace_period(tmp_path):
    """The file removed between two calls of one store (by hand, a cleaner of /var/tmp): never
    SQLite's bare `no such table`; a new file, where the holder still running re-registers and
    nobody else takes a device for one heartbeat timeout."""
    path, clock = tmp_path / "leases.db", Clock()
    store = LeaseStore(path, heartbeat_timeout_s=10, clock=clock)
    assert store.acquire("survivor", {"d0": 10}, CAP)
    for leftover in tmp_path.glob("leases.db*"):
        leftover.unlink()
    with pytest.warns(LeaseStoreRebuilt, match="was missing .*deleted while in use.*made again"):
        store.renew("survivor")  # re-registered in the new file
    assert [lease.holder for lease in store.leases()] == ["survivor"]
    other = LeaseStore(path, heartbeat_timeout_s=10, clock=clock)
    assert not other.acquire("intruder", {"d1": 10}, CAP)  # the grace period: other holders may be re-registering
    clock.now += 11
    assert other.acquire("intruder", {"d1": 10}, CAP) and not other.acquire("intruder2", {"d0": 10}, CAP)


@pytest.mark.parametrize("table", ["leases", "meta"])
def test_a_store_whose_table_was_dropped_is_rebuilt_not_a_bare_sqlite_error(tmp_path, table):
    path, clock = tmp_path / "leases.db", Clock()
    store = LeaseStore(path, heartbeat_timeout_s=10, clock=clock)
    assert store.acquire("survivor", {"d0": 10}, CAP)
    with sqlite3.connect(path) as conn:
        conn.execute(f"DROP TABLE {table}")
    with pytest.warns(LeaseStoreRebuilt, match=f"a table of its schema is missing: no such table: {table}.*moved to"):
        store.renew("survivor")
    assert [lease.holder for lease in store.leases()] == ["survivor"]
    [aside] = tmp_path.glob("leases.db.corrupt-*[0-9]")  # the damaged file, kept for inspection
    with sqlite3.connect(aside) as conn:
        assert table not in {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    # A store that opens the damaged file first (not yet verified) rebuilds it the same way.
    with sqlite3.connect(path) as conn:
        conn.execute(f"DROP TABLE {table}")
    with pytest.warns(LeaseStoreRebuilt, match="corrupt"):
        assert LeaseStore(path, heartbeat_timeout_s=10, clock=clock).usage() == {}


def test_a_store_that_stays_unusable_names_the_file_and_the_fix(tmp_path, monkeypatch):
    import cluster.leases as leases

    path = tmp_path / "leases.db"
    store = LeaseStore(path, heartbeat_timeout_s=10)
    assert store.acquire("t", {"d0": 1}, CAP)
    monkeypatch.setattr(leases, "_rows", lambda conn: conn.execute("SELECT * FROM no_such_thing").fetchall())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LeaseStoreRebuilt)
        with pytest.raises(LeaseStoreError, match=f"lease database {path} is still unusable after a rebuild .*CAMPAIGN_LEASE_DB"):
            store.leases()


def test_an_unusable_path_names_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(LeaseStoreError, match="CAMPAIGN_LEASE_DB"):
        LeaseStore(blocker / "leases.db").usage()


def test_default_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CAMPAIGN_LEASE_DB", str(tmp_path / "x.db"))
    assert LeaseStore().path == tmp_path / "x.db"


# A real file with leases, built once, that each example below damages differently.
_PRISTINE: dict[str, object] = {}


def _pristine() -> tuple[bytes, list]:
    if not _PRISTINE:
        with tempfile.TemporaryDirectory() as d:
            store = LeaseStore(Path(d) / "leases.db", clock=Clock())
            store.acquire("a", {"d0": 4, "d1": 10}, CAP)
            store.acquire("b", {"d0": 6}, CAP)
            _PRISTINE["leases"] = store.leases()
            close_kept_connections()  # as at rest, no process using it: the WAL folded into the file
            _PRISTINE["bytes"] = (Path(d) / "leases.db").read_bytes()
    return _PRISTINE["bytes"], _PRISTINE["leases"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_file_is_either_intact_or_rebuilt_never_misread(tmp_path, data):
    original, leases = _pristine()
    damaged = bytearray(original)
    for _ in range(data.draw(st.integers(1, 6), label="bytes damaged")):
        offset = data.draw(st.integers(0, len(damaged) - 1), label="offset")
        old = damaged[offset]
        damaged[offset] = data.draw(st.integers(0, 255).filter(lambda b, old=old: b != old), label="value")
    path = Path(tempfile.mkdtemp(dir=tmp_path)) / "leases.db"
    path.write_bytes(bytes(damaged))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = LeaseStore(path, clock=Clock()).leases()
    rebuilt = any(issubclass(w.category, LeaseStoreRebuilt) for w in caught)
    assert (seen == [] and rebuilt) or (seen == leases and not rebuilt)


def test_release_devices_gives_back_part_of_a_holding(tmp_path):
    store = LeaseStore(tmp_path / "partial.db")
    capacity = {"a": 10, "b": 10}
    assert store.acquire("trial", {"a": 10, "b": 10}, capacity)
    store.release_devices("trial", ["b"])
    assert store.usage() == {"a": 10}
    assert store.acquire("other", {"b": 10}, capacity)  # the given-back device is free for others
    assert not store.acquire("other2", {"a": 10}, capacity)  # the kept one is not
    store.renew("trial")  # the holder is still alive and holds what it kept
    assert {(l.holder, l.device_id) for l in store.leases()} == {("trial", "a"), ("other", "b")}


# --- turns between campaigns --------------------------------------------------------------


def test_a_waiting_campaign_gets_the_next_free_device(tmp_path):
    """Campaign a's trials end one after another; b waits. Without turns a would take every
    freed device before b polls again; with them, b gets the next one."""
    clock = Clock()
    store = LeaseStore(tmp_path / "l.db", heartbeat_timeout_s=30, clock=clock)
    cap = {"d0": 10, "d1": 10}
    assert store.acquire("a/t1@1", {"d0": 10}, cap, campaign="a")
    assert store.acquire("a/t2@1", {"d1": 10}, cap, campaign="a")
    store.wait_turn("a")  # a has more trials queued
    clock.now += 1
    store.wait_turn("b")  # b has not started any
    assert set(store.waiting()) == {"a", "b"}
    store.release("a/t1@1")
    assert not store.acquire("a/t3@1", {"d0": 10}, cap, campaign="a")  # a holds 1 device, b holds 0: b's turn
    assert store.acquire("b/t1@2", {"d0": 10}, cap, campaign="b")
    clock.now += 1
    store.release("a/t2@1")
    assert store.acquire("a/t3@1", {"d1": 10}, cap, campaign="a")  # now a holds fewer: a's turn
    # As many devices each: the one that waited longer goes first, and a start puts a campaign
    # at the back (b started a trial at t+1, a at t+2: b has waited longer now).
    clock.now += 1
    store.release("a/t3@1")
    store.release("b/t1@2")
    assert not store.acquire("a/t4@1", {"d0": 10}, cap, campaign="a")
    assert store.acquire("b/t2@2", {"d0": 10}, cap, campaign="b")
    assert store.waiting()["b"] == clock.now
    # A resize (no campaign given) is not a new trial and does not wait its turn.
    assert store.acquire("b/t1@2", {"d1": 10}, cap)


def test_a_silent_or_dead_waiter_does_not_block_anyone(tmp_path):
    clock = Clock()
    store = LeaseStore(tmp_path / "l.db", heartbeat_timeout_s=30, clock=clock)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.wait_turn("gone", pid=dead.pid)
    store.wait_turn("silent")
    clock.now += 31  # 'silent' stopped refreshing
    assert store.acquire("a/t1@1", {"d0": 10}, CAP, campaign="a")
    assert store.waiting() == {}


def test_reads_never_wait_for_a_writer_and_leave_dead_rows_to_the_next_write(tmp_path, monkeypatch):
    """A campaign polls `leases`/`usage`/`waiting` while another may be stopped inside a write
    transaction (SIGSTOP, a VM pause): the reads answer from a snapshot at once, and leave
    out, without deleting, what a dead holder or waiter left; the next write sweeps it."""
    monkeypatch.setenv("CAMPAIGN_LEASE_BUSY_S", "0.2")  # a write would give up after 0.2 s
    clock = Clock()
    store = LeaseStore(tmp_path / "l.db", heartbeat_timeout_s=30, clock=clock)
    assert store.acquire("live", {"d0": 10}, CAP)
    dead = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    assert store.acquire("dead", {"d1": 10}, CAP, pid=dead.pid)
    store.wait_turn("waits")
    store.wait_turn("gone", pid=dead.pid)
    dead.communicate()  # it ends, leaving its lease and its waiting mark behind

    def rows(table: str) -> int:
        with sqlite3.connect(store.path) as conn:
            return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]

    writer = sqlite3.connect(store.path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # another campaign, stopped while it holds the write lock
    try:
        assert [lease.holder for lease in store.leases()] == ["live"]
        assert store.usage() == {"d0": 10}
        assert set(store.waiting()) == {"waits"}
        fresh = LeaseStore(store.path, heartbeat_timeout_s=30, clock=clock)  # `campaign cluster`: a store's first use
        assert [lease.holder for lease in fresh.leases()] == ["live"]
        with pytest.raises(LeaseStoreBusy, match="stayed locked"):
            store.acquire("new", {"d2": 10}, CAP)  # a write does wait, and says why it gave up
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert rows("leases") == 2 and rows("meta WHERE key LIKE 'waiting%'") == 2  # the reads deleted nothing
    assert store.acquire("new", {"d2": 10}, CAP, campaign="waits")
    assert {lease.holder for lease in store.leases()} == {"live", "new"}
    assert rows("leases") == 2 and rows("meta WHERE key LIKE 'waiting%'") == 1  # the write swept both


# --- fencing: epochs, the renew deadline, the reclaim margin (training.fence) -------------------


def test_every_grant_has_a_new_epoch_kept_while_its_holder_renews_or_grows(tmp_path):
    from training.fence import read_fence

    clock = Clock()
    store = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=10, clock=clock)
    assert store.acquire("a", {"d0": 4}, CAP)
    epoch = store.fence("a")["epoch"]
    clock.now += 5
    store.renew("a")
    assert store.acquire("a", {"d1": 4}, CAP)  # a grow: the same grant
    assert store.fence("a")["epoch"] == epoch
    assert read_fence(store.path, "a", epoch) == (clock.now, None, None)
    assert store.acquire("b", {"d2": 4}, CAP) and store.fence("b")["epoch"] > epoch
    assert "epoch" in read_fence(store.path, "a", epoch - 1)[1]  # a worker of an older grant must stop
    store.release("a")
    assert "gone" in read_fence(store.path, "a", epoch)[1]
    assert store.acquire("a", {"d0": 4}, CAP) and store.fence("a")["epoch"] > store.fence("b")["epoch"]


@pytest.mark.parametrize("remade", ["rebuilt", "deleted"])
def test_a_file_made_again_hands_out_epochs_above_the_lost_ones(tmp_path, remade):
    """Checkpoints carry their grant's epoch, and a lower one than an older checkpoint's reads
    as a late write by a holder that lost its lease: a file made again (rebuilt, or deleted and
    made by a store that never used it) must not count from 1 again."""
    clock = Clock()
    store = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=10, clock=clock)
    for k in range(5):
        assert store.acquire(f"t{k}", {"d0": 4}, CAP)
        store.release(f"t{k}")
    assert store.acquire("before", {"d0": 4}, CAP)
    before = store.fence("before")["epoch"]
    for leftover in tmp_path.glob("leases.db*"):
        leftover.unlink()
    if remade == "rebuilt":
        (tmp_path / "leases.db").write_bytes(os.urandom(4096))
    clock.now += 60
    fresh = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=10, clock=clock)
    with pytest.warns(LeaseStoreRebuilt) if remade == "rebuilt" else contextlib.nullcontext():
        fresh.reclaim()
    clock.now += 10  # past a rebuild's grace period
    assert fresh.acquire("after", {"d1": 4}, CAP)
    assert fresh.fence("after")["epoch"] > before


def test_a_worker_stops_before_the_renew_deadline_it_cannot_see_renewed(tmp_path):
    from training.fence import Fence

    clock = Clock()
    store = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=8, clock=clock)
    assert store.acquire("a", {"d0": 4}, CAP)
    fence = Fence(store.fence("a"), clock=clock)
    assert fence.every_s == 1.0 and fence.check() is None
    clock.now += 6.5  # the holder stalled: 1.5 s left, a check every second
    assert fence.check() is None
    clock.now += 0.6  # the next check would come after the deadline: stop now
    assert "renew deadline" in fence.check()
    # The store hands the devices out only after the deadline and its margin.
    other = LeaseStore(store.path, heartbeat_timeout_s=8, clock=clock)
    clock.now += 1.9  # past the deadline (8 s), within the margin (2 s)
    assert not other.acquire("b", {"d0": 10}, CAP)
    clock.now += 1.01
    assert other.acquire("b", {"d0": 10}, CAP)
    assert "gone" in fence.check()


@pytest.mark.parametrize("renews", [True, False], ids=["re-registers", "never-renews"])
def test_a_rebuild_does_not_stop_a_live_holders_workers_before_it_re_registers(tmp_path, renews):
    """A rebuilt file has no rows until each live holder's next heartbeat puts its own back.
    Meanwhile its workers are not told "gone" (they would stop a trial that keeps its
    devices): within the grace period nobody else takes a lease, so they keep the deadline
    they knew, and stop by it if the holder never comes back."""
    from training.fence import Fence

    clock = Clock()
    holder = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=8, clock=clock)
    assert holder.acquire("a", {"d0": 4}, CAP)
    fence = Fence(holder.fence("a"), clock=clock)
    assert fence.check() is None
    (tmp_path / "leases.db").write_bytes(os.urandom(4096))
    clock.now += 2
    with pytest.warns(LeaseStoreRebuilt):
        LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=8, clock=clock).reclaim()  # another campaign notices first
    assert fence.check() is None  # not re-registered yet: not gone
    clock.now += 2
    if renews:
        holder.renew("a")  # its heartbeat: back in the new file, under the same grant
        clock.now += 5  # past the old deadline (8 s after the last renewal before the rebuild)
        assert fence.check() is None and fence.deadline == clock.now - 5 + 8
    else:
        assert fence.check() is None
        clock.now += 3.5  # 7.5 s since its last renewal: the next check would be past the deadline
        assert "renew deadline" in fence.check()
        clock.now += 20  # the grace period over: gone now
        assert "gone" in fence.check()


def test_a_rebuild_by_a_campaign_with_a_shorter_timeout_never_lets_two_holders_use_a_device(tmp_path):
    """Campaigns may renew by different timeouts. The grace period is the rebuilder's, recorded
    in the file: every store waits at least that long before it gives a lease, and a holder
    with a longer timeout (renewing less often than that period) has its workers stop before
    its end, with a quarter of it to spare, the reclaim margin."""
    from training.fence import Fence

    clock = Clock()
    slow = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=120, clock=clock)
    assert slow.acquire("a", {"d0": 4}, CAP)
    fence = Fence(slow.fence("a"), clock=clock)
    assert fence.check() is None and fence.deadline == clock.now + 120
    (tmp_path / "leases.db").write_bytes(os.urandom(4096))
    rebuilt_at = clock.now
    quick, quicker = (LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=t, clock=clock) for t in (10, 4))
    with pytest.warns(LeaseStoreRebuilt):
        quick.reclaim()  # rebuilt by the 10 s campaign: 10 s of grace
    assert fence.check() is None and fence.deadline == rebuilt_at + 7.5
    clock.now += 6.6  # the next check (every second) would come past 7.5 s
    assert "renew deadline" in fence.check()
    clock.now += 0.9  # within the grace period: nobody takes it, whatever its own timeout
    assert not quicker.acquire("b", {"d0": 4}, CAP) and not quick.acquire("b", {"d0": 4}, CAP)
    clock.now += 2.6  # past it: a quarter of the grace after the workers stopped
    assert quicker.acquire("b", {"d0": 4}, CAP)


def test_a_holder_that_stalled_past_its_deadline_is_not_brought_back_by_a_rebuild(tmp_path):
    """Its workers stopped at its renew deadline and another holder may have taken its devices
    in the lost file (a row the rebuild lost with it): waking up after the rebuild, it must not
    re-register them."""
    clock = Clock()
    stalled = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=60, clock=clock)
    assert stalled.acquire("h", {"d0": 10}, CAP)
    clock.now += 30
    stalled.renew("h")
    clock.now += 170  # stopped (SIGSTOP, a VM pause) 140 s past its deadline
    for leftover in tmp_path.glob("leases.db*"):
        leftover.unlink()
    (tmp_path / "leases.db").write_bytes(os.urandom(4096))
    with pytest.warns(LeaseStoreRebuilt), pytest.raises(LeaseLost, match="passed their renew deadline"):
        stalled.renew("h")
    assert LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=60, clock=clock).leases() == []


def test_a_checkpoint_commits_in_a_rebuilds_grace_period_before_its_holder_re_registers(tmp_path):
    from training.fence import commit_guard

    holder = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=600)
    assert holder.acquire("a", {"d0": 4}, CAP)
    guard = commit_guard(holder.fence("a"))
    (tmp_path / "leases.db").write_bytes(os.urandom(4096))
    with pytest.warns(LeaseStoreRebuilt):
        LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=600).reclaim()
    assert guard() is None  # nobody else may hold it for 600 s: the commit is safe
    holder.renew("a")
    assert guard() is None
    older = holder.fence("a")["epoch"] - 1
    assert "epoch" in commit_guard({**holder.fence("a"), "epoch": older})()  # rows of another grant are proof, grace or not


def fenced_child(lease: dict, body: str, alarm_blocked: bool = False) -> subprocess.Popen:
    """A process that watches `lease` as a trial's worker does, then runs `body`; started
    with SIGALRM blocked when `alarm_blocked` (a mask its parent left it)."""
    code = "import json, signal, sys\nfrom training.fence import watch_lease\n" \
           "fence = watch_lease(json.loads(sys.argv[1]))\nprint('watching', flush=True)\n" + textwrap.dedent(body)
    block = (lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})) if alarm_blocked else None
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(lease)], stdout=subprocess.PIPE, preexec_fn=block)


@pytest.mark.parametrize("alarm_blocked", [False, True], ids=["alarm-free", "alarm-blocked-by-its-parent"])
def test_a_worker_whose_fence_thread_cannot_run_is_still_ended_before_its_devices_change_hands(tmp_path, alarm_blocked):
    """The worker's main thread holds the GIL in one long C call, so the fence's thread never
    runs (as under heavy load, where each of its GIL hand-offs waits on the scheduler): the
    kernel's timer ends the process at the renew deadline, before another holder can take
    the devices. On a fence with only its thread, the process outlives the deadline."""
    store = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=4.0)
    assert store.acquire("a", {"d0": 4}, CAP)  # never renewed from here on: its holder "stalled"
    child = fenced_child(store.fence("a"), "sum(range(10**13))  # one C call: the GIL is never released\nprint('survived')",
                         alarm_blocked)
    try:
        assert child.stdout.readline() == b"watching\n"
        taker = LeaseStore(store.path, heartbeat_timeout_s=4.0)
        _wait_for(lambda: taker.acquire("b", {"d0": 10}, CAP), 30, "the stalled holder's devices for another holder")
        assert child.poll() == -signal.SIGALRM, "the worker still ran when its devices changed hands"
    finally:
        child.kill()
        child.wait()


def test_a_worker_of_a_launch_the_campaign_replaced_stops_itself(tmp_path):
    """Its node's lease is renewed all along (the node lives, cut off from the campaign): the
    trial folder's `launch.json` naming a later launch is what ends the worker, within its
    fence's period."""
    from training.files import write_json_atomic

    store = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=4.0)
    assert store.acquire("a", {"d0": 4}, CAP)
    marker = tmp_path / "launch.json"
    write_json_atomic(marker, {"launch": "first"})
    child = fenced_child({**store.fence("a"), "launch": "first", "launch_file": str(marker)},
                         "import time\nwhile True:\n    time.sleep(0.05)")
    try:
        assert child.stdout.readline() == b"watching\n"
        renewing = threading.Event()

        def renew() -> None:  # the node's heartbeat goes on: only the launch can end it
            while not renewing.wait(0.5):
                store.renew("a")

        thread = threading.Thread(target=renew, daemon=True)
        thread.start()
        try:
            write_json_atomic(marker, {"launch": "second"})
            assert child.wait(timeout=30) == -signal.SIGKILL
        finally:
            renewing.set()
            thread.join()
        assert [lease.holder for lease in store.leases()] == ["a"]  # the lease was never what ended it
    finally:
        child.kill()
        child.wait()


def test_a_closed_fence_leaves_no_timer_behind(tmp_path):
    """A warm worker serves one trial after another: the fence of a trial that ended must not
    end the process later, when that trial's holder has released its lease."""
    store = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=4.0)
    assert store.acquire("a", {"d0": 4}, CAP)
    child = fenced_child(store.fence("a"), """
        armed = signal.getitimer(signal.ITIMER_REAL)[0]
        fence.close()
        print(json.dumps([armed, signal.getitimer(signal.ITIMER_REAL)[0]]))
    """)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0, out
    armed, after = json.loads(out.splitlines()[1])
    assert 0 < armed <= 4.0 and after == 0.0


def test_a_holder_passes_its_device_on_in_one_transaction_and_a_waiting_campaign_keeps_its_turn(tmp_path):
    """`instead_of`: the ended trial's device goes to the next one with no moment between
    them where a third could take it; its leases go even when the next is refused (another
    campaign waits with fewer devices: its turn), and then the device is free for that one."""
    store = LeaseStore(tmp_path / "leases.db")
    whole = {"d0": 10}
    assert store.acquire("c/a@1", whole, CAP, campaign="c")
    assert store.acquire("c/b@1", whole, CAP, campaign="c", instead_of="c/a@1")
    assert {lease.holder for lease in store.leases()} == {"c/b@1"}
    assert store.fence("c/b@1")["holder"] == "c/b@1"
    store.wait_turn("other")  # holds nothing: its turn comes first
    assert not store.acquire("c/c@1", whole, CAP, campaign="c", instead_of="c/b@1")
    assert store.leases() == []  # given back all the same
    assert store.acquire("other/x@1", whole, CAP, campaign="other")


def test_a_campaigns_heartbeat_re_registers_its_holders_soon_after_a_rebuild_not_at_its_next_renewal(tmp_path):
    """A campaign renewing every 60 s (a 240 s timeout) and a rebuild by one with a 30 s
    timeout: the grace period is 30 s and the holder's workers stop at 22.5 s unless it is
    back. Its heartbeat sees the new file within seconds and re-registers it then."""
    from flows.run.live import REBUILT_POLL_S, LeaseHeartbeat
    from training.fence import Fence

    holder = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=240)
    assert holder.acquire("c/a@1", {"d0": 10}, CAP, campaign="c")
    beat = LeaseHeartbeat(holder, period_s=60)
    beat.add("c/a@1")
    try:
        for leftover in tmp_path.glob("leases.db-*"):
            leftover.unlink()
        (tmp_path / "leases.db").write_bytes(os.urandom(4096))
        quick = LeaseStore(tmp_path / "leases.db", heartbeat_timeout_s=30)
        with pytest.warns(LeaseStoreRebuilt):
            quick.reclaim()
        rebuilt_at = time.time()
        _wait_for(lambda: [lease.holder for lease in quick.leases()] == ["c/a@1"], 4 * REBUILT_POLL_S, "the holder re-registered")
        assert time.time() - rebuilt_at < 22.5
        assert Fence(holder.fence("c/a@1")).check() is None
    finally:
        beat.close()


def test_a_lease_another_process_passed_on_is_adopted_renewed_and_never_called_lost(tmp_path):
    """A warm worker moves the device from the ended trial to the next in its own store object
    (tasks/warm_worker.py): the campaign's store adopts the grant (renewed and fenced from then
    on), and its heartbeat, renewing the ended holder before it heard, counts it passed on, not lost."""
    import threading

    from flows.run.live import LeaseHeartbeat

    campaign, worker = LeaseStore(tmp_path / "leases.db"), LeaseStore(tmp_path / "leases.db")
    whole = {"d0": 10}
    assert campaign.acquire("c/a@1", whole, CAP, campaign="c")
    asked, lost = threading.Event(), []
    beat = LeaseHeartbeat(campaign, period_s=0.02, on_lost=lost.append, passed_on=lambda holder: asked.set() or holder == "c/a@1")
    beat.add("c/a@1")
    assert worker.acquire("c/b@1", whole, CAP, pid=os.getpid(), campaign="c", instead_of="c/a@1")
    assert asked.wait(10)
    campaign.adopt("c/b@1", worker.grant("c/b@1"))
    campaign.forget("c/a@1")
    beat.passed("c/a@1", "c/b@1")
    assert campaign.fence("c/b@1") == worker.fence("c/b@1")
    campaign.renew("c/b@1")  # its own now: renewed as if it had acquired it
    beat.close()
    assert lost == [] and campaign.leases() == []  # and given back with the campaign's others at its end


def test_a_store_kept_open_reads_the_file_that_replaced_its_own_not_the_one_moved_aside(tmp_path):
    """Each thread keeps its connection open between transactions; a rebuild elsewhere moves
    the file aside and makes a new one under the path: the next transaction is on the new file."""
    path = tmp_path / "leases.db"
    mine = LeaseStore(path, clock=Clock())
    assert mine.acquire("a", {"d0": 4}, CAP)
    assert [lease.holder for lease in mine.leases()] == ["a"]
    for suffix in ("", "-wal", "-shm"):  # moved aside whole, as a rebuild does
        if Path(f"{path}{suffix}").exists():
            os.replace(f"{path}{suffix}", f"{tmp_path}/aside.db{suffix}")
    assert LeaseStore(path, clock=Clock()).leases() == []  # another process makes the new file
    assert mine.leases() == []
    assert mine.acquire("b", {"d0": 4}, CAP)
    assert [lease.holder for lease in LeaseStore(path, clock=Clock()).leases()] == ["b"]
