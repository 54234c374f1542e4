"""Host-wide device leases: no device (or share of its memory) is ever given out twice.

Every campaign on a host shares one SQLite file (WAL mode). A lease is taken in one write
transaction (BEGIN IMMEDIATE, which serialises writers across processes), renewed by
heartbeat, released on completion, and reclaimed when its holder's process is gone or its
heartbeat expired. A holder is the unit: all of its devices come and go together.

The file is never trusted blindly. Each row carries a checksum and the schema, header and
integrity are checked when a store first opens the file; a file that fails is moved aside
(kept for inspection), rebuilt empty, and a `LeaseStoreRebuilt` warning is emitted. Live
holders re-register from their own memory on their next heartbeat, and for one heartbeat
timeout after a rebuild nobody else may take a lease, so a rebuild cannot hand a device
that is still in use to a second trial.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import socket
import sqlite3
import stat
import threading
import time
import uuid
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import Iterable, TypeVar

from training.errors import CampaignError

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA_VERSION = 2  # 2: every row carries its grant's epoch (fencing)
_APPLICATION_ID = 0x43414D50  # "CAMP" in the SQLite header: this file is ours
_BUSY_TIMEOUT_S = 30.0  # how long a writer waits for another campaign's transaction
BUSY_ENV = "CAMPAIGN_LEASE_BUSY_S"  # overrides it (tests hold the file locked past it)
TIMEOUT_ENV = "CAMPAIGN_LEASE_TIMEOUT_S"  # the heartbeat timeout of stores made without one
_SCHEMA = (
    "CREATE TABLE meta (key TEXT NOT NULL PRIMARY KEY, value TEXT NOT NULL, crc INTEGER NOT NULL) STRICT",
    "CREATE TABLE leases (holder TEXT NOT NULL, device_id TEXT NOT NULL,"
    " memory_bytes INTEGER NOT NULL CHECK (memory_bytes > 0), pid INTEGER NOT NULL, pid_start INTEGER,"
    " acquired_at REAL NOT NULL, heartbeat_at REAL NOT NULL, capacity_bytes INTEGER NOT NULL,"
    " origin TEXT NOT NULL, epoch INTEGER NOT NULL, crc INTEGER NOT NULL, PRIMARY KEY (holder, device_id)) STRICT",
)
# SQLite errors that say something about the machine (locks, disk, permissions), not the
# file's content: they are raised, never answered by rebuilding the file.
_ENVIRONMENT_ERRORS = {
    sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN,
    sqlite3.SQLITE_FULL, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_NOMEM, sqlite3.SQLITE_PERM,
    sqlite3.SQLITE_INTERRUPT,
}  # fmt: skip


class LeaseError(RuntimeError):
    """A lease could not be had or kept."""


class LeaseLost(LeaseError):
    """The holder's leases were reclaimed (heartbeat expired, or taken after a rebuild)."""


class LeaseUnavailable(LeaseError):
    """`hold` could not take every claimed device now."""


class LeaseStoreBusy(LeaseError, sqlite3.OperationalError):
    """Another process held the lease database locked for longer than the busy timeout. Not
    fatal: the caller tries again later, while its leases (renewed when the file frees) hold."""


class LeaseStoreError(CampaignError):
    """The lease database cannot be used where it is (path, permissions, disk)."""


class LeaseStoreRebuilt(UserWarning):
    """The lease database was corrupt; it was moved aside and rebuilt."""


@dataclass(frozen=True, slots=True)
class Lease:
    """One device (or a share of its memory) held by one holder (a trial)."""

    holder: str
    device_id: str
    memory_bytes: int
    pid: int  # the process whose life the lease follows
    pid_start: int | None  # its start time (clock ticks after boot): a reused pid differs
    acquired_at: float  # wall-clock seconds, comparable across processes
    heartbeat_at: float
    capacity_bytes: int = 0  # the device's capacity as the holder saw it
    origin: str = ""  # "host|boot id|pid namespace" in which `pid` means something, then "|" the heartbeat timeout it renews by
    epoch: int = 0  # the grant: grows with every new grant on the host, kept while the holder renews or grows


@dataclass(slots=True)
class _Held:
    """What this process holds, kept to re-register it after the file is rebuilt."""

    claims: dict[str, int]
    capacity: dict[str, int]
    pid: int
    generation: str
    acquired_at: float
    epoch: int = 0
    renewed_at: float = 0.0  # its last renewal that went through (0: not known): a rebuild never brings back an expired one


class HeldLease:
    """Yielded by `LeaseStore.hold`: says whether the heartbeat lost the lease."""

    def __init__(self, holder: str) -> None:
        self.holder = holder
        self._lost: LeaseLost | None = None

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def check(self) -> None:
        """Raises LeaseLost if the lease was reclaimed while held: stop using the devices."""
        if self._lost is not None:
            raise self._lost


class _Corrupt(Exception):
    """The file's content cannot be trusted (internal: triggers a rebuild)."""


# The host's one store, whoever runs: a folder every local user reaches, under no one's HOME
# (a store per HOME, user or container gave each its own devices). /var/tmp survives a reboot
# and is shared by every user on the host; a lease never outlives a boot (`_death_reason`).
HOST_DIR_ENV = "CAMPAIGN_HOST_DIR"  # moves the host's store folder (the same for every user of the host)
DEFAULT_HOST_DIR = Path("/var/tmp/campaign")
DB_ENV = "CAMPAIGN_LEASE_DB"  # one file of the caller's choosing (tests; a store shared some other way)


def host_dir() -> Path:
    return Path(os.environ.get(HOST_DIR_ENV) or DEFAULT_HOST_DIR)


def default_path() -> Path:
    if env := os.environ.get(DB_ENV):
        return Path(env).expanduser()
    return host_dir() / "leases.db"


def is_host_store(path: Path) -> bool:
    """Whether `path` is the host's shared store (its folder and files made usable by every user)."""
    return not os.environ.get(DB_ENV) and Path(path) == host_dir() / "leases.db"


def prepare_host_dir(folder: Path) -> None:
    """The host store's folder, made if missing as /tmp is (1777: every user may create files
    there, and only a file's owner may remove or rename it, so no user can delete the store
    from under the others); checked if present. An administrator may instead make it for one
    group of GPU users (`chgrp gpu DIR; chmod 3770 DIR`): the store's files then follow the
    folder's group. LeaseStoreError (exit 2) naming the folder and the fix if this user cannot
    use it: a private store instead would share the devices with nobody."""
    try:
        made = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        info = folder.lstat()
        if made and stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
            os.chmod(folder, 0o1777)  # mkdir honours the umask
            info = folder.lstat()
    except OSError as e:
        raise LeaseStoreError(_no_access(folder, str(e))) from e
    if not stat.S_ISDIR(info.st_mode):
        raise LeaseStoreError(_no_access(folder, "it is not a folder (a link or a file is never followed)"))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LeaseStoreError(_no_access(folder, f"mode {stat.S_IMODE(info.st_mode):o}, owner uid {info.st_uid}, "
                                                 f"group gid {info.st_gid}: user uid {os.geteuid()} may not write there"))


def check_host_files(db: Path) -> None:
    """Every file of the host store that exists is writable by this user (SQLite needs the -wal
    and -shm files even to read); else LeaseStoreError naming the file and its owner."""
    for path in (db, *(Path(f"{db}{suffix}") for suffix in (".lock", "-wal", "-shm"))):
        with suppress(FileNotFoundError):
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode) or not os.access(path, os.R_OK | os.W_OK):
                raise LeaseStoreError(_no_access(db.parent, f"{path.name} has mode {stat.S_IMODE(info.st_mode):o} and "
                                                            f"owner uid {info.st_uid}: user uid {os.geteuid()} may not write it"))


def _no_access(folder: Path, why: str) -> str:
    return (f"cannot use the host's device lease store in {folder} ({why}). Every user of this host's devices leases "
            f"them there: ask the host's administrator to make it writable for them (`mkdir -p {folder} && chmod 1777 "
            f"{folder}`, or for one group: `chgrp GROUP {folder} && chmod 3770 {folder}`), or set {HOST_DIR_ENV} to the "
            f"same writable folder for every user of the host")


class LeaseStore:
    """The host's lease file. Cheap to create; every call opens its own connection."""

    def __init__(
        self,
        path: Path | str | None = None,
        heartbeat_timeout_s: float | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if heartbeat_timeout_s is None:
            heartbeat_timeout_s = float(os.environ.get(TIMEOUT_ENV) or 60.0)
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self.path = Path(path).expanduser() if path is not None else default_path()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._verified = False
        self._shared_ready = False  # the host store's folder and files checked (once per store)
        self._held: dict[str, _Held] = {}
        self._held_lock = threading.Lock()  # the heartbeat thread renews while callers acquire

    # --- public API ----------------------------------------------------------------------

    def acquire(
        self, holder: str, claims: Mapping[str, int], capacity: Mapping[str, int], pid: int | None = None,
        *, campaign: str | None = None, instead_of: str | None = None,
    ) -> bool:
        """Leases every claimed device to `holder`, or none; False if any does not fit.

        `claims` maps device id -> bytes wanted; a claim equal to the device's capacity
        takes it exclusively. A holder may call again to grow or change its claims. For
        one heartbeat timeout after the file was rebuilt every acquire is refused, so
        that the holders still running can re-register first.

        With `campaign` (a new trial of that campaign starting), the acquire also waits its
        turn: it is refused while another campaign waits (`wait_turn`) that holds fewer
        devices, or as many and has waited longer. Without it, a campaign whose trials end
        one after another would take every freed device before a waiting one polls again.

        With `instead_of`, that holder's leases are released in the same transaction first,
        whether or not this one's are granted (a trial's devices passed on to the next).
        """
        _check_claims(holder, claims, capacity)
        pid = os.getpid() if pid is None else pid
        pid_start = process_start(pid)
        if pid_start is None and not _pid_exists(pid):
            raise ValueError(f"pid {pid} is not a running process: a lease must follow a live one")
        previous = self._held.get(holder)
        acquired_at = previous.acquired_at if previous else None

        def take(conn: sqlite3.Connection) -> tuple[str, int] | None:
            now = self._clock()
            if instead_of is not None:
                conn.execute("DELETE FROM leases WHERE holder = ?", (instead_of,))
            live, _ = self._sweep(conn, now)
            # The holder's own rows past its renew deadline are an ended tenure (its workers
            # stopped themselves): what it takes now is a new grant, with a new epoch.
            if ended := [r for r in live if r.holder == holder and now - r.heartbeat_at > self.heartbeat_timeout_s]:
                conn.execute("DELETE FROM leases WHERE holder = ?", (holder,))
                live = [r for r in live if r not in ended]
            if self._in_grace(conn, now):
                log.info("lease %s refused: lease file rebuilt, waiting for live holders", holder)
                return None
            if campaign is not None and (ahead := _waiting_ahead(conn, live, campaign, now, self.heartbeat_timeout_s)):
                log.info("lease %s deferred: campaign %s waits with fewer devices", holder, ahead)
                return None
            kept = next((r.epoch for r in live if r.holder == holder), None)
            epoch = kept if kept is not None else _next_epoch(conn)
            lease = Lease(holder, "", 0, pid, pid_start, acquired_at or now, now, 0, self._origin(), epoch)
            if not _fit_and_write(conn, live, lease, claims, capacity):
                return None
            if campaign is not None:
                _restart_wait(conn, campaign, now)  # it had its turn: its next trial queues behind the others
            return _generation(conn), epoch

        taken = self._run(take)
        if instead_of is not None:
            with self._held_lock:
                self._held.pop(instead_of, None)
        if taken is None:
            return False
        generation, epoch = taken
        with self._held_lock:
            kept = previous if previous and previous.generation == generation else None
            self._held[holder] = _Held(
                {**(kept.claims if kept else {}), **claims},
                {**(kept.capacity if kept else {}), **capacity},
                pid,
                generation,
                acquired_at or self._clock(),
                epoch,
                self._clock(),
            )
        return True

    def grant(self, holder: str) -> dict[str, object]:
        """What this store object knows of `holder`'s grant, for another process's store to
        `adopt` (a warm worker passes its device on in a lease transaction of its own:
        tasks/warm_worker.py, and its campaign renews the lease from then on)."""
        held = self._held[holder]
        return {"claims": dict(held.claims), "capacity": dict(held.capacity), "pid": held.pid,
                "generation": held.generation, "acquired_at": held.acquired_at, "epoch": held.epoch}

    def adopt(self, holder: str, grant: Mapping[str, object]) -> None:
        """Hold `holder`'s leases as another store object granted them (`grant`): renewed,
        re-registered after a rebuild and fenced from this one from now on."""
        with self._held_lock:
            self._held[holder] = _Held(dict(grant["claims"]), dict(grant["capacity"]), int(grant["pid"]),
                                       str(grant["generation"]), float(grant["acquired_at"]), int(grant["epoch"]))

    def forget(self, holder: str) -> None:
        """`holder`'s leases were given back by another store object (see `adopt`)."""
        with self._held_lock:
            self._held.pop(holder, None)

    def fence(self, holder: str) -> dict[str, object]:
        """What a holder's workers need to watch its lease themselves (training.fence): the
        file, the holder, its grant's epoch and the renew deadline's rule."""
        held = self._held[holder]
        return {"db": str(self.path), "holder": holder, "epoch": held.epoch, "timeout_s": self.heartbeat_timeout_s}

    @property
    def reclaim_margin_s(self) -> float:
        """How long after a holder's renew deadline its leases may be reclaimed: its workers
        check the deadline at least every heartbeat period and stop by it (training.fence),
        so a holder that stalled (SIGSTOP, a VM pause) has stopped using the devices by then."""
        return self.heartbeat_timeout_s / 4

    def wait_turn(self, campaign: str, pid: int | None = None) -> None:
        """`campaign` has trials waiting for devices: other campaigns' new trials give way to it
        (see `acquire`). Call again at least every heartbeat timeout while it waits."""
        pid = os.getpid() if pid is None else pid

        def mark(conn: sqlite3.Connection) -> None:
            now = self._clock()
            since = _waiters(conn, now, self.heartbeat_timeout_s).get(campaign, (now,))[0]
            _put_meta(conn, WAITING + campaign, f"{since} {now} {pid} {process_start(pid) or ''}")

        self._run(mark)

    def stop_waiting(self, campaign: str) -> None:
        self._run(lambda conn: conn.execute("DELETE FROM meta WHERE key = ?", (WAITING + campaign,)))

    def waiting(self) -> dict[str, float]:
        """Campaigns waiting for devices now -> since when."""
        return self._run(lambda conn: {c: w[0] for c, w in _waiters(
            conn, self._clock(), self.heartbeat_timeout_s, drop_stale=False).items()}, write=False)

    def renew(self, holder: str) -> None:
        """Heartbeat. Re-registers after a rebuild; raises LeaseLost if the leases are gone."""
        held = self._held.get(holder)

        def beat(conn: sqlite3.Connection) -> str:
            now = self._clock()
            generation = _generation(conn)
            if held is not None and held.generation != generation:
                return self._reregister(conn, holder, held, now)
            rows = [r for r in _rows(conn) if r.holder == holder]
            if not rows or any(_death_reason(r, now, self.heartbeat_timeout_s, self.reclaim_margin_s) for r in rows):
                raise LeaseLost(f"the leases of {holder} were reclaimed; its devices may be in use elsewhere")
            if any(now - r.heartbeat_at > self.heartbeat_timeout_s for r in rows):
                # Past its renew deadline its workers have stopped themselves (training.fence):
                # renewing now would claim devices nobody of ours uses, and that may be taken.
                raise LeaseLost(f"the leases of {holder} passed their renew deadline (the campaign stalled "
                                f"{now - max(r.heartbeat_at for r in rows):.1f} s); its workers stopped")
            _write(conn, [replace(r, heartbeat_at=now) for r in rows])
            return generation, now

        generation, renewed_at = self._run(beat)
        if held is not None:
            with self._held_lock:
                held.generation, held.renewed_at = generation, renewed_at

    def rebuilt(self) -> bool:
        """Whether the file was made again since this store's holders last wrote to it (one
        read): their heartbeat then renews at once, re-registering them early in the rebuild's
        grace period, which may be shorter than their own renew period."""
        with self._held_lock:
            known = {held.generation for held in self._held.values()}
        return bool(known) and self._run(_generation, write=False) not in known

    def release(self, holder: str) -> None:
        """Gives back every device of `holder` (nothing happens if it holds none)."""
        self._run(lambda conn: conn.execute("DELETE FROM leases WHERE holder = ?", (holder,)))
        with self._held_lock:
            self._held.pop(holder, None)

    def release_devices(self, holder: str, device_ids: Iterable[str]) -> None:
        """Gives back some of `holder`'s devices (a trial that shrank); it keeps the rest."""
        gone = list(device_ids)
        self._run(lambda conn: conn.executemany(
            "DELETE FROM leases WHERE holder = ? AND device_id = ?", [(holder, d) for d in gone]))
        with self._held_lock:
            held = self._held.get(holder)
            if held is not None:
                held.claims = {d: c for d, c in held.claims.items() if d not in gone}

    def reclaim(self) -> list[Lease]:
        """Removes the leases of dead holders (process gone or heartbeat expired); returns them."""
        removed = self._run(lambda conn: self._sweep(conn, self._clock())[1])
        for lease in removed:
            log.info("reclaimed %s from %s (pid %d)", lease.device_id, lease.holder, lease.pid)
        return removed

    def leases(self) -> list[Lease]:
        """Every live lease on the host. A read: dead holders' rows are left out, not
        deleted (the next write sweeps them), so a campaign polling this never queues
        behind, or blocks, another campaign's write transaction."""
        return self._run(lambda conn: self._live_and_dead(_rows(conn), self._clock())[0], write=False)

    def usage(self) -> dict[str, int]:
        """Leased bytes per device id, of the live holders (a read, as `leases`)."""
        used: dict[str, int] = {}
        for lease in self.leases():
            used[lease.device_id] = used.get(lease.device_id, 0) + lease.memory_bytes
        return used

    @contextmanager
    def hold(
        self,
        holder: str,
        claims: Mapping[str, int],
        capacity: Mapping[str, int],
        heartbeat_s: float | None = None,
    ) -> Iterator[HeldLease]:
        """Acquires, renews from a daemon thread while the block runs, then releases.

        Raises LeaseUnavailable if the claims do not fit now. If the heartbeat finds the
        lease gone, `HeldLease.lost` turns true: the caller should stop using the devices.
        """
        if not self.acquire(holder, claims, capacity):
            raise LeaseUnavailable(f"{holder}: devices {sorted(claims)} are not free now")
        handle = HeldLease(holder)
        stop = threading.Event()
        period = heartbeat_s if heartbeat_s is not None else self.heartbeat_timeout_s / 4
        thread = threading.Thread(
            target=self._heartbeat, args=(handle, period, stop), name=f"lease-heartbeat:{holder}", daemon=True
        )
        thread.start()
        try:
            yield handle
        finally:
            stop.set()
            thread.join()
            self.release(holder)

    # --- transactions --------------------------------------------------------------------

    def _run(self, op: Callable[[sqlite3.Connection], T], write: bool = True) -> T:
        """Runs `op` in one transaction; a corrupt file is rebuilt and `op` retried.

        A write transaction (BEGIN IMMEDIATE) takes the file's one write lock for its whole
        length; a read (`write=False`) sees one consistent snapshot and, in WAL mode, never
        waits for a writer, not even one stopped while it holds the lock."""
        for attempt in range(2):
            try:
                if self._verified and not self.path.exists():
                    # Deleted while in use (by hand, a cleaner of /var/tmp): SQLite would make an
                    # empty file without a word. Rebuilt instead, with its grace period: the
                    # holders still running re-register before anyone takes their devices.
                    raise _Corrupt("the file was deleted while in use")
                with self._file_lock(exclusive=False), self._kept_connection() as conn:
                    if not self._verified:
                        self._prepare(conn)
                    conn.execute("BEGIN IMMEDIATE" if write else "BEGIN DEFERRED")
                    try:
                        result = op(conn)
                    except BaseException:
                        _rollback(conn)
                        raise
                    conn.execute("COMMIT")
                    return result
            except LeaseStoreBusy:
                raise
            except (_Corrupt, sqlite3.DatabaseError, UnicodeDecodeError) as e:
                if _is_busy(e):
                    raise LeaseStoreBusy(f"lease database {self.path} stayed locked by another process for "
                                         f"{_busy_timeout_s():g} s ({e})") from e
                # Until this store has verified the file, any error about its content is
                # corruption; afterwards only SQLite's own corruption codes are. Text that
                # is not UTF-8 (in a row, or in SQLite's message quoting a damaged schema)
                # can only come from damage: this module writes nothing else.
                if isinstance(e, sqlite3.DatabaseError) and not (_is_corruption(e, strict=self._verified) or _schema_gone(e)):
                    raise
                if attempt:
                    raise LeaseStoreError(
                        f"lease database {self.path} is still unusable after a rebuild ({e}): move {self.path}* "
                        f"aside (no campaign of this host may run meanwhile), or set {DB_ENV} to a writable local path"
                    ) from e
                self._rebuild(f"a table of its schema is missing: {e}" if isinstance(e, sqlite3.DatabaseError) and _schema_gone(e)
                              else str(e))
        raise AssertionError("unreachable")

    def _sweep(self, conn: sqlite3.Connection, now: float) -> tuple[list[Lease], list[Lease]]:
        """Deletes dead holders' rows; returns (live leases, removed leases)."""
        live, dead = self._live_and_dead(_rows(conn), now)
        if dead:
            conn.executemany("DELETE FROM leases WHERE holder = ?", [(h,) for h in {r.holder for r in dead}])
        return live, dead

    def _live_and_dead(self, rows: list[Lease], now: float) -> tuple[list[Lease], list[Lease]]:
        """Rows split by holder: a holder with any row past reclaim (process gone, deadline and
        margin passed) is dead with all of its rows."""
        dead = {r.holder for r in rows if _death_reason(r, now, self.heartbeat_timeout_s, self.reclaim_margin_s)}
        return [r for r in rows if r.holder not in dead], [r for r in rows if r.holder in dead]

    def _origin(self) -> str:
        """Where the holder's pid means something, and the heartbeat timeout it renews by:
        whoever judges the holder judges it by that, not by its own (campaigns may run with
        different timeouts, `CAMPAIGN_LEASE_TIMEOUT_S`)."""
        return f"{_this_host()}|{self.heartbeat_timeout_s!r}"

    def _in_grace(self, conn: sqlite3.Connection, now: float) -> bool:
        meta = _meta(conn)
        rebuilt_at = meta.get("rebuilt_at")
        grace = max(self.heartbeat_timeout_s, float(meta.get("grace_s", 0)))  # the rebuilder's, if longer than ours
        return rebuilt_at is not None and now - float(rebuilt_at) < grace

    def _reregister(self, conn: sqlite3.Connection, holder: str, held: _Held, now: float) -> tuple[str, float]:
        """Puts back a live holder's leases in a rebuilt file, if nobody took them since and its
        renew deadline has not passed (its workers stopped by it, and the lost file may have
        given its devices to another holder meanwhile, whose row the rebuild lost)."""
        if held.renewed_at and now - held.renewed_at > self.heartbeat_timeout_s:
            raise LeaseLost(f"the lease file was rebuilt after the leases of {holder} passed their renew deadline "
                            f"({now - held.renewed_at:.1f} s since their last renewal); its workers stopped")
        live, _ = self._sweep(conn, now)
        lease = Lease(
            holder, "", 0, held.pid, process_start(held.pid), held.acquired_at, now, 0, self._origin(), held.epoch
        )
        _next_epoch(conn, at_least=held.epoch)  # the rebuilt file's counter never hands this epoch out again
        if not _fit_and_write(conn, live, lease, held.claims, held.capacity):
            raise LeaseLost(f"the lease file was rebuilt and {holder}'s devices were taken meanwhile")
        log.warning("re-registered the leases of %s in the rebuilt lease file", holder)
        return _generation(conn), now

    def _heartbeat(self, handle: HeldLease, period: float, stop: threading.Event) -> None:
        while not stop.wait(period):
            try:
                self.renew(handle.holder)
            except LeaseLost as e:
                handle._lost = e
                log.error("%s", e)
                return
            except (sqlite3.Error, LeaseStoreError) as e:
                # A busy or briefly unwritable file: the next beat tries again; only an
                # expired heartbeat (judged by others) makes the lease lapse.
                log.warning("heartbeat of %s failed (%s); retrying", handle.holder, e)

    # --- the file ------------------------------------------------------------------------

    @contextmanager
    def _kept_connection(self) -> Iterator[sqlite3.Connection]:
        """A connection this thread keeps open between its transactions on the file under the
        path (called under the shared file lock, so no rebuild replaces the file meanwhile),
        dropped once a transaction on it fails. A connection opened and closed for each
        transaction made SQLite create the WAL file and fold it into the database as it
        closed: five fsyncs for one lease, where a kept one commits with one."""
        try:
            found = os.stat(self.path)
        except OSError:  # not made yet: made by this transaction's connection, not kept
            found = None
        if found is None:
            with self._connection() as conn:
                yield conn
            return
        kept = _kept_connections.__dict__.setdefault("by_file", {})
        key = (os.getpid(), str(self.path), found.st_dev, found.st_ino, _busy_timeout_s())
        conn = kept.get(key)
        if conn is None:
            for stale in [k for k in kept if k[1] == key[1]]:  # the file under the path was replaced (a rebuild)
                _close_quietly(kept.pop(stale))
            while len(kept) >= KEPT_PER_THREAD:  # the oldest other file's (a process rarely uses more than one)
                _close_quietly(kept.pop(next(iter(kept))))
            conn = kept[key] = self._open()
        try:
            yield conn
        except BaseException:
            _close_quietly(kept.pop(key, conn))  # whatever the failure, the next transaction starts afresh
            raise

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=_busy_timeout_s(), isolation_level=None)
        conn.execute("PRAGMA synchronous = FULL")
        return conn

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        conn = self._open()
        try:
            yield conn
        finally:
            conn.close()

    @contextmanager
    def _file_lock(self, exclusive: bool) -> Iterator[None]:
        """Shared for every transaction, exclusive to rebuild: no one works on a file
        while it is being moved aside, and two processes never rebuild in turn."""
        lock_path = self.path.with_name(self.path.name + ".lock")
        if not self._shared_ready and is_host_store(self.path):
            self._share_host_store(lock_path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides who shares it
        except OSError as e:
            raise LeaseStoreError(
                f"cannot use lease database {self.path} ({e}): set CAMPAIGN_LEASE_DB to a writable local path"
            ) from e
        try:
            _flock_within(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, lock_path)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _share_host_store(self, lock_path: Path) -> None:
        """The host's store, usable by every user of the host: its folder made or checked, its
        files made before SQLite would (with the umask's mode) and given the folder's sharing."""
        folder = self.path.parent
        prepare_host_dir(folder)
        shared = 0o666 if folder.stat().st_mode & 0o002 else 0o660
        for path in (self.path, lock_path):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, shared)
            except FileExistsError:
                continue
            except OSError as e:
                raise LeaseStoreError(_no_access(folder, f"{path.name}: {e}")) from e
            try:
                os.fchmod(fd, shared)  # past the umask; SQLite gives its -wal and -shm this mode too
            finally:
                os.close(fd)
        check_host_files(self.path)
        self._shared_ready = True

    def _prepare(self, conn: sqlite3.Connection) -> None:
        """Creates the schema in a new file, or checks an existing one; once per store. A
        file already made in WAL mode is only read here, so that a store's first use, a read
        included, does not wait for another process's write transaction."""
        if _app_id(conn) == 0 or conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            conn.execute("BEGIN IMMEDIATE")
            try:
                empty = _app_id(conn) == 0 and not conn.execute("SELECT 1 FROM sqlite_master").fetchone()
                if empty:
                    _create(conn, {"generation": uuid.uuid4().hex, "epoch": first_epoch(self._clock())})
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise
            # Outside a transaction, as SQLite requires; WAL lets readers run beside a writer.
            conn.execute("PRAGMA journal_mode = WAL")
        _verify(conn)
        self._verified = True

    def _rebuild(self, reason: str) -> None:
        with self._file_lock(exclusive=True):
            if self._healthy():
                self._verified = False  # someone else rebuilt it while we waited
                return
            aside = Path(f"{self.path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
            missing = not self.path.exists()  # deleted: only its -wal and -shm may be left to move
            for suffix in ("", "-wal", "-shm", "-journal"):
                # A stale -wal beside a new file could be replayed into it: move all.
                if Path(f"{self.path}{suffix}").exists():
                    try:
                        os.replace(f"{self.path}{suffix}", f"{aside}{suffix}")
                    except PermissionError as e:  # the host store's folder: only a file's owner moves it
                        owner = Path(f"{self.path}{suffix}").stat().st_uid
                        raise LeaseStoreError(f"lease database {self.path} is corrupt ({reason}) and only its owner "
                                              f"(uid {owner}) or root may move it aside: ask them to run any `campaign` "
                                              f"command, or remove {self.path}* as root") from e
            if is_host_store(self.path):  # the new file shared with every user as the first was
                self._share_host_store(self.path.with_name(self.path.name + ".lock"))
            with self._connection() as conn:
                conn.execute("BEGIN IMMEDIATE")
                _create(
                    conn,
                    {
                        "generation": uuid.uuid4().hex,
                        "epoch": first_epoch(self._clock()),
                        "rebuilt_at": repr(self._clock()),
                        # How long nobody may take a lease: stores with shorter timeouts wait
                        # this long too, and live holders' workers stop before its end unless
                        # their holder re-registered (training.fence).
                        "grace_s": repr(self.heartbeat_timeout_s),
                        "moved_to": str(aside),
                    },
                )
                conn.execute("COMMIT")
                conn.execute("PRAGMA journal_mode = WAL")
        self._verified = False
        what = (f"lease database {self.path} was missing ({reason}); made again" if missing else
                f"lease database {self.path} was corrupt ({reason}); moved to {aside} and rebuilt")
        warnings.warn(
            LeaseStoreRebuilt(
                f"{what}."
                f" Live holders re-register on their next heartbeat; new leases wait"
                f" {self.heartbeat_timeout_s:g}s for them."
            ),
            stacklevel=4,
        )

    def _healthy(self) -> bool:
        if not self.path.exists():
            return False
        try:
            with self._connection() as conn:
                _verify(conn)
            return True
        except (_Corrupt, UnicodeDecodeError):
            return False
        except sqlite3.DatabaseError as e:
            if _is_corruption(e, strict=False):
                return False
            raise


# --- rows ---------------------------------------------------------------------------------


def _fit_and_write(
    conn: sqlite3.Connection,
    live: list[Lease],
    lease: Lease,
    claims: Mapping[str, int],
    capacity: Mapping[str, int],
) -> bool:
    """Writes `lease`'s holder's rows for `claims` if every device has room; else nothing.

    A device's capacity is the smallest any holder of it declared, so a campaign that
    believes a device is smaller (and took it exclusively) is never overfilled by another.
    """
    others = [r for r in live if r.holder != lease.holder]
    for device, claim in claims.items():
        on_device = [r for r in others if r.device_id == device]
        room = min([capacity[device], *(r.capacity_bytes for r in on_device)])
        if sum(r.memory_bytes for r in on_device) + claim > room:
            return False
    # The holder is one unit: its other devices take the new pid and heartbeat too.
    kept = {r.device_id: r for r in live if r.holder == lease.holder}
    rows = [
        replace(lease, device_id=d, memory_bytes=kept[d].memory_bytes, capacity_bytes=kept[d].capacity_bytes)
        for d in kept
        if d not in claims
    ]
    rows += [
        replace(lease, device_id=d, memory_bytes=c, capacity_bytes=capacity[d]) for d, c in claims.items()
    ]
    _write(conn, rows)
    return True


def _write(conn: sqlite3.Connection, rows: list[Lease]) -> None:
    values = [astuple(_as_stored(r)) for r in rows]
    conn.executemany(
        "INSERT OR REPLACE INTO leases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", [(*v, _crc(v)) for v in values]
    )


def _as_stored(r: Lease) -> Lease:
    """The lease as SQLite gives it back, so that its checksum matches on reading."""
    return Lease(
        str(r.holder), str(r.device_id), int(r.memory_bytes), int(r.pid),
        None if r.pid_start is None else int(r.pid_start), float(r.acquired_at),
        float(r.heartbeat_at), int(r.capacity_bytes), str(r.origin), int(r.epoch),
    )  # fmt: skip


def _rollback(conn: sqlite3.Connection) -> None:
    with suppress(sqlite3.Error):  # a broken connection: closing it drops the transaction
        conn.rollback()


def _rows(conn: sqlite3.Connection) -> list[Lease]:
    out = []
    for *values, crc in conn.execute("SELECT * FROM leases"):
        if _crc(tuple(values)) != crc:
            raise _Corrupt(f"lease row of {values[0]!r} on {values[1]!r} fails its checksum")
        out.append(Lease(*values))
    return out


def _meta(conn: sqlite3.Connection) -> dict[str, str]:
    meta = {}
    for key, value, crc in conn.execute("SELECT key, value, crc FROM meta"):
        if _crc((key, value)) != crc:
            raise _Corrupt(f"meta entry {key!r} fails its checksum")
        meta[key] = value
    return meta


WAITING = "waiting:"  # meta key prefix: "waiting:<campaign>" -> "since seen_at pid pid_start"


def _put_meta(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?, ?)", (key, value, _crc((key, value))))


def _waiters(
    conn: sqlite3.Connection, now: float, timeout_s: float, drop_stale: bool = True
) -> dict[str, tuple[float, float]]:
    """Live waiting campaigns -> (since, seen_at); entries of dead or silent ones are left
    out, and deleted when `drop_stale` (in a write transaction)."""
    out, stale = {}, []
    for key, value in _meta(conn).items():
        if not key.startswith(WAITING):
            continue
        since, seen, pid, start = (value.split(" ") + [""])[:4]
        alive = process_alive(int(pid), int(start) if start else None)
        if now - float(seen) > timeout_s or not alive:
            stale.append((key,))
        else:
            out[key[len(WAITING):]] = (float(since), float(seen))
    if stale and drop_stale:
        conn.executemany("DELETE FROM meta WHERE key = ?", stale)
    return out


def _restart_wait(conn: sqlite3.Connection, campaign: str, now: float) -> None:
    value = _meta(conn).get(WAITING + campaign)
    if value is not None:
        _put_meta(conn, WAITING + campaign, " ".join([str(now), *value.split(" ")[1:]]))


def _waiting_ahead(conn: sqlite3.Connection, live: list[Lease], campaign: str, now: float, timeout_s: float) -> str | None:
    """A waiting campaign that should have the next devices before `campaign`, if any: one
    holding fewer devices, or as many and waiting longer (holders are "<campaign>/<trial>...")."""
    waiters = _waiters(conn, now, timeout_s)
    held: dict[str, set[str]] = {}
    for r in live:
        held.setdefault(r.holder.split("/", 1)[0], set()).add(r.device_id)
    ours = (len(held.get(campaign, ())), waiters.get(campaign, (now,))[0])
    ahead = [(len(held.get(c, ())), since, c) for c, (since, _) in waiters.items() if c != campaign]
    ahead = [a for a in ahead if a[:2] < ours]
    return min(ahead)[2] if ahead else None


def first_epoch(now: float) -> str:
    """A new file's epoch counter: the time in milliseconds, so that a file made again (deleted,
    rebuilt) hands out epochs above every one the lost file did. Checkpoints carry their
    grant's epoch, and one written under a lower epoch than an older one of the same lease
    file is taken for a late write by a holder that had lost its lease (training.manifest)."""
    return str(int(now * 1000))


def _next_epoch(conn: sqlite3.Connection, at_least: int = 0) -> int:
    """The next grant's epoch (meta "epoch" + 1), stored; never below `at_least` + 1."""
    epoch = max(int(_meta(conn).get("epoch", "0")), at_least) + 1
    _put_meta(conn, "epoch", str(epoch))
    return epoch


def _generation(conn: sqlite3.Connection) -> str:
    """A random id given to each new file: a change tells holders the file was rebuilt."""
    try:
        return _meta(conn)["generation"]
    except KeyError:
        raise _Corrupt("the file has no generation id") from None


def _create(conn: sqlite3.Connection, meta: Mapping[str, str]) -> None:
    for statement in _SCHEMA:
        conn.execute(statement)
    conn.executemany("INSERT INTO meta VALUES (?, ?, ?)", [(k, v, _crc((k, v))) for k, v in meta.items()])
    conn.execute(f"PRAGMA application_id = {_APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _verify(conn: sqlite3.Connection) -> None:
    """Raises _Corrupt unless the file is our schema, intact, and every row checks out."""
    try:
        _check_file(conn)
    except sqlite3.DatabaseError as e:
        # The file is already under suspicion: any error that is not about the machine
        # (even "no such table" from a damaged schema) means its content is not ours.
        if not _is_corruption(e, strict=False):
            raise
        raise _Corrupt(str(e)) from e
    except ValueError as e:  # a meta value that does not parse, or text that is not UTF-8
        raise _Corrupt(str(e)) from e


def _check_file(conn: sqlite3.Connection) -> None:
    if _app_id(conn) != _APPLICATION_ID:
        raise _Corrupt("not a campaign lease database (application id)")
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version != SCHEMA_VERSION:
        raise _Corrupt(f"schema version {version}, expected {SCHEMA_VERSION}")
    if _schema(conn) != _expected_schema():
        raise _Corrupt("unexpected tables or indexes")
    problems = [row[0] for row in conn.execute("PRAGMA integrity_check")]
    if problems != ["ok"]:
        raise _Corrupt(f"integrity check: {problems[0]}")
    _rows(conn)
    _generation(conn)
    float(_meta(conn).get("rebuilt_at", "0"))


def _schema(conn: sqlite3.Connection) -> set[tuple]:
    return set(conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master"))


@functools.cache
def _expected_schema() -> frozenset[tuple]:
    conn = sqlite3.connect(":memory:")
    for statement in _SCHEMA:
        conn.execute(statement)
    return frozenset(_schema(conn))


def _app_id(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA application_id").fetchone()[0]


def _crc(values: tuple) -> int:
    return zlib.crc32(repr(values).encode())


# Per thread: (pid, path, device, inode, busy timeout) -> a connection kept open between
# transactions (LeaseStore._kept_connection); the pid, so that a forked child never uses its
# parent's.
_kept_connections = threading.local()
KEPT_PER_THREAD = 4


def close_kept_connections() -> None:
    """This thread's kept connections closed (the last connection to a file to close folds its
    WAL into the file, as when the process exits)."""
    for conn in _kept_connections.__dict__.pop("by_file", {}).values():
        _close_quietly(conn)


def _close_quietly(conn: sqlite3.Connection) -> None:
    with suppress(sqlite3.Error):
        conn.close()


def _flock_within(fd: int, kind: int, lock_path: Path) -> None:
    """flock, waiting at most the busy timeout: a process stopped inside a transaction (a
    debugger, SIGSTOP) keeps its lock, and a wait without end would stop this one, its
    heartbeat included, without a word."""
    deadline = time.monotonic() + _busy_timeout_s()
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LeaseStoreBusy(f"lease database lock {lock_path} stayed held by another process for {_busy_timeout_s():g} s "
                                     f"(one stopped in the middle of a lease change? `fuser {lock_path}` names it)") from None
            time.sleep(0.005)


def _busy_timeout_s() -> float:
    return float(os.environ.get(BUSY_ENV) or _BUSY_TIMEOUT_S)


def _is_busy(e: BaseException) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _schema_gone(e: sqlite3.DatabaseError) -> bool:
    """Whether SQLite says a table or column of ours is not in the file: its schema was
    dropped, or the file was deleted and SQLite made an empty one in its place. This module's
    statements are fixed, so that is never a mistake of ours: the file is rebuilt as if corrupt."""
    code = getattr(e, "sqlite_errorcode", None)
    return (code is not None and code & 0xFF == sqlite3.SQLITE_ERROR
            and str(e).startswith(("no such table", "no such column", "table leases has", "table meta has")))


def _is_corruption(e: sqlite3.DatabaseError, strict: bool = True) -> bool:
    """Strict: only SQLite's own corruption codes. Otherwise (while checking a file that
    is already suspect) any error that is not about the machine counts as corruption."""
    code = getattr(e, "sqlite_errorcode", None)
    primary = code & 0xFF if code is not None else None
    if strict:
        return primary in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)
    return primary not in _ENVIRONMENT_ERRORS


def _check_claims(holder: str, claims: Mapping[str, int], capacity: Mapping[str, int]) -> None:
    if not holder:
        raise ValueError("a lease needs a holder name")
    if not claims:
        raise ValueError(f"{holder}: claims no device")
    for device, claim in claims.items():
        if device not in capacity:
            raise ValueError(f"{holder}: no capacity given for device {device!r}")
        if not 0 < claim <= capacity[device]:
            raise ValueError(
                f"{holder}: claim of {claim} bytes on {device!r} is not in 1..{capacity[device]}"
            )


# --- processes ----------------------------------------------------------------------------


def _death_reason(lease: Lease, now: float, timeout_s: float, margin_s: float = 0.0) -> str | None:
    """Why `lease`'s holder counts as dead, or None while it may be alive. An expired
    heartbeat counts only `margin_s` after the renew deadline (fencing: training.fence).
    A row that says which timeout its holder renews by is judged by that one, and its
    margin by the same share of it (a row written before rows said so: by the caller's)."""
    host, boot, namespace, own_timeout = (lease.origin.split("|") + ["", "", "", ""])[:4]
    with suppress(ValueError):
        if (holders := float(own_timeout)) > 0:
            margin_s, timeout_s = margin_s * holders / timeout_s, holders
    if now - lease.heartbeat_at > timeout_s + margin_s:
        return "heartbeat expired"
    here_host, here_boot, here_namespace = _this_host().split("|")
    if host != here_host:
        return None  # another machine's pid means nothing here: the heartbeat decides
    if boot != here_boot:
        return "host rebooted since"
    if namespace != here_namespace:
        return None  # another container's pid: the heartbeat decides
    if not process_alive(lease.pid, lease.pid_start):
        return "process gone"
    return None


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (Linux), None if unknown."""
    stat = _proc_stat(pid)
    return int(stat[19]) if stat else None


def process_alive(pid: int, pid_start: int | None) -> bool:
    """Whether `pid` runs and is the same process that started at `pid_start`."""
    stat = _proc_stat(pid)
    if stat is None:
        return _pid_exists(pid)
    if stat[0] in ("Z", "X"):  # exited, not yet reaped by its parent
        return False
    return pid_start is None or int(stat[19]) == pid_start


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


@functools.cache
def _this_host() -> str:
    def read(path: str, link: bool = False) -> str:
        try:
            return os.readlink(path) if link else Path(path).read_text().strip()
        except OSError:
            return ""

    boot = read("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}|{boot}|{read('/proc/self/ns/pid', link=True)}"
