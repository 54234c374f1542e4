"""Fencing: a trial's workers watch their holder's lease and stop by themselves.

The campaign renews its leases from a heartbeat thread; a campaign that stalls (SIGSTOP, a
debugger, a long swap or GC pause, a frozen VM) stops renewing but its trials' processes go
on. After the renew deadline (last renewal + heartbeat timeout) another campaign may take
the devices once the lease store's safety margin has passed (cluster.leases). So each
worker process checks, from a thread of its own and at least once per heartbeat period,
when its holder last renewed and under which grant (epoch); it ends itself (SIGKILL: it
saves nothing, the last verified checkpoint stands) before the deadline it can no longer
see renewed, or at once when the lease is gone or was granted again. The stalled process
is the campaign's: that is why the check runs here, not there.

The thread is not enough on its own: under load it may not run for seconds (the CPU is
oversubscribed, or the training thread holds the GIL through a long C call, and each of the
check's GIL hand-offs waits on the scheduler). So every deadline the thread reads is also
armed as a kernel timer (ITIMER_REAL, whose SIGALRM is left at its default action: end the
process). If the thread falls behind, the kernel ends the process at the deadline it last
saw, with no Python code needing to run: starvation can cost a worker its run (it resumes
from its checkpoint), never a device shared.

A pool trial's folder may be shared by its nodes. A node cut off from the campaign but alive
(its network to the Prefect server down, its storage still mounted) keeps its lease, since
its lease file is its own, and would train on into the folder while the campaign, which sees
the node dead, launches the trial again elsewhere. So each launch names itself in the
trial's folder (`launch.json`, written by the campaign before it sends the segments), and a
worker whose lease carries a launch that is no longer the folder's stops the same way, and
commits no checkpoint once it is not.
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from training.files import read_json


FENCED = 75  # exit code of a launch refused for a lost lease (EX_TEMPFAIL: the campaign queues the trial again)


class Fenced(RuntimeError):
    """The holder's lease was lost when a checkpoint was about to be committed: it was not."""


GRACE_SHARE = 0.75  # a worker not re-registered stops by this share of a rebuild's grace: the rest is the reclaim margin


def read_fence(path: str | Path, holder: str, epoch: int, now: float | None = None,
               grace_s: float = 0.0) -> tuple[float | None, str | None, float | None]:
    """What a trial's workers watching their holder (Fence) read, read-only: (when the
    holder's leases were last renewed, None, None), or (None, why they are no longer its
    grant, None), or, when the file was rebuilt and the holder has not re-registered yet
    (it does at its next heartbeat), (None, None, the moment its workers must stop by): within
    the rebuild's grace period nobody else takes a lease, so they go on to the earlier of the
    deadline they knew and GRACE_SHARE of that period (`grace_s` where the file does not
    record its own). sqlite3.Error when the file cannot be read now (the caller keeps what it
    knew).

    The file and its schema are cluster/leases.py's (a worker is below the cluster layer:
    it reads just these columns of its tables, never writes)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=0.5)
    try:
        rows = conn.execute("SELECT epoch, heartbeat_at FROM leases WHERE holder = ?", (holder,)).fetchall()
        meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('rebuilt_at', 'grace_s')").fetchall()) if not rows else {}
    finally:
        conn.close()
    if not rows:
        if "rebuilt_at" in meta and now is not None:
            stop_by = float(meta["rebuilt_at"]) + GRACE_SHARE * float(meta.get("grace_s", grace_s))
            if now < stop_by:
                return None, None, stop_by
        return None, f"the leases of {holder} are gone (reclaimed or released)", None
    if any(int(e) != epoch for e, _ in rows):
        return None, f"the leases of {holder} were granted again (epoch {rows[0][0]}, this trial runs under {epoch})", None
    return min(float(h) for _, h in rows), None, None


def launched_again(lease: dict[str, Any]) -> str | None:
    """Why a worker of `lease`'s launch must stop because the trial was launched again (the
    trial folder's `launch.json` names another launch), or None: the same launch, no launch
    named (a trial not on a pool's shared folder), or the file unreadable this instant (no proof)."""
    path = lease.get("launch_file")
    if not path:
        return None
    try:
        current = (read_json(Path(path)) or {})["launch"]  # bounded: a file in a folder others write
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if current == lease["launch"]:
        return None
    return (f"the trial was launched again (launch {current}; this process is of launch {lease['launch']}, "
            f"whose node the campaign lost)")


class Fence:
    """The holder's renew deadline as this process last saw it; `check` refreshes it."""

    def __init__(self, lease: dict[str, Any], clock=time.time):
        self.lease = lease
        self.db, self.holder, self.epoch = str(lease["db"]), str(lease["holder"]), int(lease["epoch"])
        self.timeout_s = float(lease["timeout_s"])
        # Twice per heartbeat period (timeout / 4), at most a second apart: the deadline is
        # seen in time with room to spare before the store's reclaim margin runs out.
        self.every_s = min(self.timeout_s / 8, 1.0)
        self.clock = clock
        self.deadline = clock() + self.every_s * 2  # until the first read: as good as a fresh grant's, no more
        self._closed = threading.Event()
        self._lock = threading.Lock()  # close() and the thread's re-arming: never armed after close

    def check(self) -> str | None:
        """None while this process may go on using its devices, else why it must stop."""
        if (superseded := launched_again(self.lease)) is not None:
            return superseded
        now = self.clock()
        try:
            # Within a rebuild's grace period a holder not re-registered yet is not gone: the
            # deadline known so far holds, brought forward to before that period's end.
            renewed_at, problem, stop_by = read_fence(self.db, self.holder, self.epoch, now, grace_s=self.timeout_s)
        except sqlite3.Error as e:  # unreadable now: the deadline known so far still holds
            renewed_at, problem, stop_by = None, None, None
            if now + self.every_s >= self.deadline:
                return f"the lease file {self.db} could not be read ({e}) and the renew deadline of {self.holder} is near"
        if problem is not None:
            return problem
        if renewed_at is not None:
            self.deadline = renewed_at + self.timeout_s
        if stop_by is not None:
            self.deadline = min(self.deadline, stop_by)
        if now + self.every_s >= self.deadline:  # the next check would be too late
            return f"the lease of {self.holder} was not renewed for {now - self.deadline + self.timeout_s:.1f} s " \
                   f"(its campaign stalled or cannot reach the lease file): renew deadline reached"
        return None

    def watch(self) -> "Fence":
        """Check now (a launch on a lost lease ends at once), then from a daemon thread, with
        the kernel's timer as the backstop at each deadline read (see the module's doc)."""
        if (problem := self.check()) is not None:
            _stop(problem, FENCED)
        _alarm_ends_process()
        self._arm()
        threading.Thread(target=self._run, name="lease-fence", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._closed.wait(self.every_s):
            problem = self.check()
            with self._lock:
                if self._closed.is_set():  # the trial ended meanwhile: a warm worker's next one has its own
                    return
                if problem is not None:
                    _stop(problem, None)
                self._arm()

    def _arm(self) -> None:
        """The kernel ends this process at the deadline unless it is armed again first."""
        signal.setitimer(signal.ITIMER_REAL, max(self.deadline - self.clock(), 0.001))

    def close(self) -> None:
        """The trial is over in this process (a warm worker goes on to the next one)."""
        with self._lock:
            self._closed.set()
            signal.setitimer(signal.ITIMER_REAL, 0)


@contextmanager
def stops_when_fenced():
    """A checkpoint commit refused for a lost lease (Fenced) ends this process at once, as
    the fence's thread would: no cleanup, no other save, nothing more on the device."""
    try:
        yield
    except Fenced as e:
        _stop(str(e), None)


def _alarm_ends_process() -> None:
    """SIGALRM at its default action (end the process): the fence's timer needs no Python
    code to run. From the main thread it is set so; elsewhere a handler found is refused."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        # A mask is inherited through fork and exec: a parent that blocked SIGALRM would
        # leave it pending here for good. One thread that takes it is enough.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    elif signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, None):
        raise RuntimeError("training.fence: SIGALRM has a handler in this process, so the lease's timer "
                           "could not end it; start the fence from the main thread, before any handler")


def _stop(problem: str, code: int | None) -> None:
    print(f"fenced: {problem}; this process stops now (its trial resumes from its last checkpoint)", file=sys.stderr, flush=True)
    if code is not None:
        os._exit(code)
    os.kill(os.getpid(), signal.SIGKILL)  # nothing more may run on the device: no cleanup, no save


def watch_lease(lease: dict[str, Any] | None) -> Fence | None:
    """Start fencing this process on `lease` (TrialConfig.lease); None when there is none
    (a trial run by hand, without a campaign)."""
    return Fence(lease).watch() if lease else None


def lease_problem(lease: dict[str, Any] | None) -> str | None:
    """Why a launch on `lease` must not start (gone, granted again, past its deadline), or None."""
    return Fence(lease).check() if lease else None


def commit_guard(lease: dict[str, Any] | None):
    """What a checkpoint commit asks just before it makes a checkpoint visible: None while
    the holder still holds its grant and its launch is the trial's, else why not (None for a
    trial run by hand). The
    fence's thread checks twice a heartbeat period; this closes the gap for the one write
    that matters, the one a resume would trust.

    Only proof refuses a commit: the lease gone or granted again, its renew deadline read
    and passed, or the trial launched again. A lease file that cannot be read this instant (a writer's lock) is not
    proof; the fence's thread, which knows the deadline, acts on that near it."""
    if not lease:
        return None
    db, holder, epoch, timeout_s = str(lease["db"]), str(lease["holder"]), int(lease["epoch"]), float(lease["timeout_s"])

    def check() -> str | None:
        if (superseded := launched_again(lease)) is not None:
            return superseded
        try:
            # In a rebuild's grace period (before its stop_by) nobody else holds the devices.
            renewed_at, problem, _ = read_fence(db, holder, epoch, time.time(), grace_s=timeout_s)
        except sqlite3.Error:
            return None
        if problem is not None:
            return problem
        if renewed_at is not None and time.time() >= renewed_at + timeout_s:
            return f"the lease of {holder} was not renewed for {time.time() - renewed_at:.1f} s: renew deadline passed"
        return None

    return check


def grant_of(lease: dict[str, Any] | None) -> dict[str, Any] | None:
    """The grant a checkpoint is written under, for its manifest: which lease file (host and
    path: epochs grow per file) and the epoch."""
    if not lease:
        return None
    return {"lease_file": f"{socket.gethostname()}:{lease['db']}", "epoch": int(lease["epoch"])}
