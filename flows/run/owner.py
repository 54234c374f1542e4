"""One live run per campaign: `launch` and `resume` own their campaign's folder while they run.

Two runs of one campaign would train the same trial twice at once, delete each other's
checkpoints in flight and send MLflow every step twice. So a run takes the campaign's owner
lock before anything else: an exclusive `flock` on `<runs_dir>/<campaign>/owner.lock`, a
kernel lock that dies with its holder (a SIGKILL, the OOM killer, a reboot), so a dead owner
is never waited for and two live ones can never both hold it. Beside it `owner.json` says who
holds it (host, pid, user, since), for the refusal's message, and is renewed every few
seconds: a folder shared between hosts whose file system does not carry locks across them
(some NFS set-ups) still refuses a second run while the first one's record is renewed.
Across hosts nothing is judged by the clocks, which may disagree: a record of another host
(another kernel: hostname and boot id, as containers may share a hostname) is alive when it
is seen renewed within OBSERVE_S here, and a renewal that finds the record no longer its
own (another host took the campaign over, judging this run dead) writes nothing and says so
(`on_lost`: the CLI stops the run). Two hosts that claim a campaign with no record in the
same instant can both start: the file system offers nothing atomic across them here.

`campaign status`, `logs` and `resize` never take the lock: they keep working beside the run
(`run_alive` tries a shared lock and drops it at once; a claim in that moment waits for it).
"""

from __future__ import annotations

import fcntl
import functools
import getpass
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from cluster.leases import process_alive
from training.errors import CampaignError
from training.files import read_status_json, write_json_atomic

LOCK_NAME, RECORD_NAME = "owner.lock", "owner.json"
RENEW_S = 5.0  # how often the owner's record is renewed
FRESH_S = 30.0  # `campaign status`: another host's record younger than this (by the clocks) reads as a live run
OBSERVE_S = 2 * RENEW_S + 1.0  # a claim watches another host's record this long: renewed meanwhile, its run is alive
PROBE_WAIT_S = 0.5  # a claim waits this long for the lock while `run_alive` probes it


@functools.cache
def boot_id() -> str:
    """This kernel's boot id: two machines (or VMs) may share a hostname, two containers on one
    kernel share this and their flocks too."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class CampaignBusy(CampaignError):
    """The campaign already has a live run (the message names it and what to do)."""


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    user: str
    since: float
    renewed: float
    command: str
    boot: str = ""  # the host's boot id ("": written before records carried it)

    @property
    def elsewhere(self) -> bool:
        """Held on another kernel: its flock does not reach this one, nor its pid mean anything here."""
        return self.host != socket.gethostname() or bool(self.boot and self.boot != boot_id())

    def same_run(self, other: "Owner | None") -> bool:
        return other is not None and (self.host, self.boot, self.pid, self.since) == (other.host, other.boot, other.pid, other.since)

    def describe(self) -> str:
        return (f"`campaign {self.command}` by {self.user} on host {self.host}, pid {self.pid}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}")


def _owner_problem(raw) -> str | None:
    if not isinstance(raw, dict) or set(raw) - {"boot"} != set(Owner.__dataclass_fields__) - {"boot"}:
        return "not an owner record"
    return None


def read_owner(campaign_dir: Path) -> Owner | None:
    raw = read_status_json(campaign_dir / RECORD_NAME, _owner_problem)
    try:
        return None if raw is None else Owner(**raw)
    except TypeError:
        return None


def run_is_live(campaign_dir: Path) -> bool:
    """Whether a run of the campaign is going on now (its owner record names a live process
    here, or was renewed lately on another host). Read only: it takes no lock, so it never
    makes a launch that claims the campaign at this moment fail."""
    owner = read_owner(campaign_dir)
    if owner is None:
        return False
    if not owner.elsewhere:
        return process_alive(owner.pid, None)
    return time.time() - owner.renewed < FRESH_S


def renewed_while_watched(campaign_dir: Path, seen: Owner, watch_s: float) -> Owner | None:
    """The record of another host's run if it is renewed (or taken by yet another run) within
    `watch_s`, else None: that run is gone. No clock of another host is compared with ours."""
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        time.sleep(min(0.2, watch_s))
        now = read_owner(campaign_dir)
        if now is not None and (now.renewed != seen.renewed or not now.same_run(seen)):
            return now
    return None


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a uid with no name (a container's)
        return f"uid {os.getuid()}"


class CampaignOwnership:
    """The held lock and the thread that renews the record; `release` when the run ends (the
    kernel drops the lock by itself if the process dies first)."""

    def __init__(self, campaign_dir: Path, fd: int, owner: Owner, made: Path | None = None,
                 on_lost: Callable[[Owner], None] | None = None):
        self.campaign_dir, self.fd, self.owner, self.made = campaign_dir, fd, owner, made
        self.on_lost = on_lost
        self.lost: Owner | None = None  # the run of another host that took the campaign over
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="campaign-owner", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            there = read_owner(self.campaign_dir)
            if there is not None and not self.owner.same_run(there):
                # Another host judged this run dead (it was not seen renewing: stopped, cut
                # off) and took the campaign: writing ours again would make two owners.
                self.lost = there
                if self.on_lost is not None:
                    self.on_lost(there)
                return
            try:
                write_json_atomic(self.campaign_dir / RECORD_NAME, asdict(self.owner) | {"renewed": time.time()}, durable=False)
            except OSError:
                pass  # a full or read-only disk: the kernel lock still holds on this host

    def release(self) -> None:
        """Idempotent. A run that made the campaign's folder and ended before writing anything
        else there (refused input) leaves no folder behind."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        try:
            if self.lost is None:  # the record is another run's now
                (self.campaign_dir / RECORD_NAME).unlink(missing_ok=True)
            if self.made is not None and [p.name for p in self.campaign_dir.iterdir()] == [LOCK_NAME]:
                (self.campaign_dir / LOCK_NAME).unlink()  # under the lock: a claim checks its file is still the path's
                for folder in [self.campaign_dir, *self.campaign_dir.parents]:
                    folder.rmdir()
                    if folder == self.made:
                        break
        except OSError:
            pass  # not empty, or not ours to remove
        os.close(self.fd)  # drops the lock


def claim_campaign(campaign_dir: Path, name: str, command: str,
                   on_lost: Callable[[Owner], None] | None = None) -> CampaignOwnership:
    """Own the campaign's folder for this process's run, or CampaignBusy naming the live owner.
    `on_lost`: called (from the renewing thread) if a run on another host takes it over."""
    made = next((d for d in reversed([campaign_dir, *campaign_dir.parents]) if not d.exists()), None)
    while True:
        try:
            campaign_dir.mkdir(parents=True, exist_ok=True)
            # Its mode from the umask, as every file of the runs folder: a folder shared by a
            # group (umask 002) lets the group's next run open the lock after this one ended.
            fd = os.open(campaign_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise CampaignError(f"cannot take campaign {name}'s owner lock in {campaign_dir} ({e}): the runs folder "
                                "(tracking.runs_dir) must be writable") from e
        if not _lock_soon(fd):
            os.close(fd)
            raise CampaignBusy(_busy(name, _holder(campaign_dir))) from None
        if _same_file(fd, campaign_dir / LOCK_NAME):
            break
        os.close(fd)  # a refused run removed the file we locked as it left: take the new one
    other = read_owner(campaign_dir)
    if other is not None and other.elsewhere and (alive := renewed_while_watched(campaign_dir, other, OBSERVE_S)) is not None:
        os.close(fd)  # a live run on another host of a shared folder, whose lock did not reach us
        raise CampaignBusy(_busy(name, alive))
    now = time.time()
    owner = Owner(socket.gethostname(), os.getpid(), _user(), now, now, command, boot_id())
    write_json_atomic(campaign_dir / RECORD_NAME, asdict(owner), durable=False)
    return CampaignOwnership(campaign_dir, fd, owner, made, on_lost)


def _lock_soon(fd: int, wait_s: float = PROBE_WAIT_S) -> bool:
    """The exclusive lock, waiting out a moment of `run_alive`'s shared probe (microseconds long)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)


def run_alive(campaign_dir: Path) -> bool:
    """Whether a run owns the campaign now (another process holds its lock, or another host's
    record is fresh), read without owning it: a shared lock tried and dropped at once."""
    try:
        fd = os.open(campaign_dir / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # never launched here, or its folder is gone: no run holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the probe's lock, if it got one
    other = read_owner(campaign_dir)
    return other is not None and other.elsewhere and time.time() - other.renewed < FRESH_S


def _same_file(fd: int, path: Path) -> bool:
    try:
        held, there = os.fstat(fd), path.stat()
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)


def _holder(campaign_dir: Path, wait_s: float = 5.0) -> Owner | None:
    """The record of the run that holds the lock: the holder writes it just after it took the
    lock, so a run refused in that moment waits for it (a leftover of a dead run names a
    process that is gone here, and is not the holder's)."""
    deadline = time.monotonic() + wait_s
    while True:
        owner = read_owner(campaign_dir)
        if owner is not None and (owner.elsewhere or process_alive(owner.pid, None)):
            return owner
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _busy(name: str, owner: Owner | None) -> str:
    who = owner.describe() if owner is not None else "another process (its owner.json is not readable yet)"
    return (f"campaign {name} is already running: {who}. A second run would train its trials twice; watch the "
            f"running one with `campaign status --watch` or `campaign logs -f TRIAL`, or wait for it to end (or stop "
            f"it: SIGTERM or Ctrl-C in its terminal) and run this again")
