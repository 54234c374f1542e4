"""Small files in and out, in one place.

Writes are atomic: a reader sees the old file or the new one, never half of one.
Reads are bounded, whatever the path turns out to be: every file the product reads (the
spec, records, manifests, request.json) goes through `read_bounded`, which takes regular
files only (a FIFO would block, /dev/zero would never end), opens without blocking, reads at
most limit + 1 bytes (a size from stat is not a bound: a file can grow while it is read),
and `loads_json` refuses nesting deeper than a record ever has before the parser recurses.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from training.errors import CampaignError

MAX_RECORD_BYTES = 16 << 20  # campaign.json of a long search is the largest record: well under this
MAX_DEPTH = 64  # a record nests 4 or 5 levels; json's C parser recurses per level


class InputError(CampaignError, ValueError):
    """A file the product reads is not what it should be; the message names it and the fix."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _open_regular(path: Path, fix: str) -> int:
    """A read-only descriptor on the regular file at `path`, opened without blocking
    (FileNotFoundError passes through; anything else that is not a regular file: InputError)."""
    try:
        before = os.stat(path)
    except NotADirectoryError:
        raise FileNotFoundError(path) from None
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise InputError(f"{path} cannot be read ({e.strerror}): {fix}") from None
    if not stat.S_ISREG(before.st_mode):
        raise InputError(f"{path} is {_kind(before.st_mode)}, not a regular file: {fix}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise InputError(f"{path} cannot be opened ({e.strerror}): {fix}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InputError(f"{path} is {_kind(st.st_mode)}, not a regular file: {fix}")
    return fd


def read_chunk(path: str | Path, position: int, limit: int = 1 << 20, fix: str = "replace it with a regular file") -> bytes:
    """At most `limit` bytes of the regular file at `path` from byte `position` (a log that
    is followed: read a bounded piece at a time, whatever its size or type)."""
    path = Path(path)
    fd = _open_regular(path, fix)
    try:
        return os.pread(fd, limit, position)
    except OSError as e:
        raise InputError(f"{path} cannot be read ({e.strerror}): {fix}") from None
    finally:
        os.close(fd)


def read_bounded(path: str | Path, limit: int, fix: str = "replace it with a regular file") -> bytes:
    """The bytes of the regular file at `path` (symlinks followed), at most `limit` of them.

    FileNotFoundError passes through (callers decide what a missing file means); anything
    else that is not a regular file of at most `limit` bytes raises InputError naming `path`
    and `fix`. Nothing is written, and nothing blocks: the type is checked before opening
    (opening some devices has effects) and again on the open descriptor (the path may have
    been swapped in between), and O_NONBLOCK keeps a FIFO swapped in from blocking the open.
    """
    path = Path(path)
    fd = _open_regular(path, fix)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise InputError(f"{path} is {st.st_size} bytes, more than the {limit} allowed: {fix}")
        chunks, left = [], limit + 1  # one byte over the limit tells a file that grew while read
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise InputError(f"{path} cannot be read ({e.strerror}): {fix}") from None
    finally:
        os.close(fd)
    if left <= 0:
        raise InputError(f"{path} grew past {limit} bytes while it was read: {fix}")
    return b"".join(chunks)


# A JSON string, unrolled so that a long one costs one pass, not one alternation per character.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth_exceeds(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than `limit` (stops at the first level past it)."""
    if text.count("[") + text.count("{") <= limit:
        return False  # not enough openers to nest that deep: the common case, no scan
    depth = 0
    for m in _BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > limit:
            return True
    return False


def loads_json(text: str | bytes, source: str | Path, limit: int = MAX_DEPTH) -> Any:
    """Parse JSON from `source` (named in errors) with a nesting limit; InputError if it is not JSON."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        if json_depth_exceeds(text, limit):
            raise InputError(f"{source} nests deeper than {limit} levels: it is not a record this program wrote; "
                             "remove it or restore it from a copy")
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InputError(f"{source} is not valid JSON ({e.__class__.__name__}: {e}): remove it or restore it "
                         "from a copy") from None


# The errors of a file system that has no room left for this user: the whole disk, or the quota.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(CampaignError, OSError):
    """A write failed for want of room (ENOSPC, EDQUOT): the message names what was being written,
    how much its file system has free, and the fix. An OSError still (errno kept), so that code
    that tolerates a failed write goes on tolerating it."""

    def __init__(self, path: str | Path, code: int = errno.ENOSPC, what: str = "", room: str | None = None):
        self.path, self.what = str(path), what
        self.room = room if room is not None else free_space(path)  # as it was when the write failed
        super().__init__(code, os.strerror(code), self.path)

    def __str__(self) -> str:
        room = "disk quota exceeded" if self.errno == errno.EDQUOT else "disk full"
        fix = ("free some space there (your quota on it is used up)" if self.errno == errno.EDQUOT
               else "free some space there")
        return (f"{room}: cannot write {self.what}{self.path} ({self.strerror}); {self.room}: {fix}, or set "
                f"tracking.runs_dir to a folder on a file system with room, then `campaign resume` (trials resume from "
                f"their last checkpoint)")

    def __reduce__(self):  # pickled whole (a Prefect state, a worker's reply): the message comes back the same
        return (type(self), (self.path, self.errno, self.what, self.room))


def size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _mount_point(path: Path) -> Path:
    """The folder its file system is mounted at: what people know a disk by (`df` shows it)."""
    try:
        device = path.stat().st_dev
        while path != path.parent and path.parent.stat().st_dev == device:
            path = path.parent
    except OSError:
        pass
    return path


def available_bytes(path: str | Path) -> int | None:
    """What this user may still write on the file system holding `path` (or its nearest folder
    that exists); None when it cannot be told."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def free_space(path: str | Path) -> str:
    """How much room the file system holding `path` (or its nearest folder that exists) has left,
    in words: "12.0 KiB free of 1.0 MiB on the file system at /mnt/runs"."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError as e:
        return f"the free space of {where}'s file system is unknown ({e.strerror})"
    return f"{size_text(usage.free)} free of {size_text(usage.total)} on the file system at {_mount_point(where)}"


def no_room(exc: BaseException | None) -> OSError | None:
    """The ENOSPC or EDQUOT OSError behind `exc`, if any: itself, what caused it (raise ... from,
    or during handling), or one rank's failure inside a checkpoint's CheckpointException
    (torch.distributed.checkpoint gathers each rank's exception into its `failures`)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_ROOM:
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if isinstance(f, (tuple, BaseException))]
    return None


def disk_full_in(exc: BaseException, path: str | Path | None = None, what: str = "") -> DiskFull | None:
    """`exc` as a DiskFull naming `path` (else the file the OSError names), or None when no
    ENOSPC/EDQUOT is behind it."""
    if isinstance(exc, DiskFull):
        return exc
    full = no_room(exc)
    if full is None:
        return None
    if isinstance(full, DiskFull):
        return full
    return DiskFull(path if path is not None else full.filename or "?", full.errno, what)


@contextlib.contextmanager
def naming_a_full_disk(path: str | Path, what: str = "") -> Iterator[None]:
    """Within it, an ENOSPC or EDQUOT becomes a DiskFull naming `path` (the file or folder being
    written), its file system's free space and the fix, instead of `[Errno 28] No space left on
    device` naming nothing."""
    try:
        yield
    except OSError as e:
        if (full := disk_full_in(e, path, what)) is None or full is e:
            raise
        raise full from e


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once, at import: os.umask can only be read by setting it


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """Replace `path` whole. `durable=False` skips the fsync (a status file a crash may lose:
    the rename still keeps readers from seeing half of it)."""
    path = Path(path)
    with naming_a_full_disk(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; records are read by people and tools like any file
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def write_json_atomic(path: Path, obj: Any, durable: bool = True) -> None:
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), durable)


def read_json(path: Path, limit: int = MAX_RECORD_BYTES) -> Any | None:
    """The file's JSON, or None when it does not exist (yet); InputError (naming it) when it
    is not a regular file, is over `limit` bytes, nests too deep or is not JSON."""
    try:
        data = read_bounded(path, limit, fix="remove it or restore it from a copy")
    except FileNotFoundError:
        return None
    return loads_json(data, path)


MAX_LOG_BYTES = 64 << 20  # a line log (resizes, allocations) of a long campaign: well under this


def append_json_line(path: Path, obj: Any) -> None:
    """Add one JSON line to a line log. One write on an O_APPEND descriptor: lines from several
    writers (the campaign and a trial's agent) never interleave, and a reader sees whole lines
    or, after a crash mid-write, a last line without its newline (which readers skip)."""
    path = Path(path)
    data = (json.dumps(obj, sort_keys=True) + "\n").encode()
    with naming_a_full_disk(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def read_json_lines(path: Path, problem: Callable[[Any], str | None], limit: int = MAX_LOG_BYTES) -> list[Any]:
    """The lines of a line log that are records (`problem(line)` is None), in order; [] when
    there is no log (yet). A line that is not one (junk, another version's, cut short by a
    crash) is skipped with one warning naming the file, its line and what is wrong: a log is
    history, and one bad line must not hide the rest. InputError (naming the file) if it is
    not a regular file or is over `limit` bytes."""
    try:
        data = read_bounded(path, limit, fix="remove it or restore it from a copy")
    except FileNotFoundError:
        return []
    records, bad = [], []
    lines = data.split(b"\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if number == len(lines):  # no newline after it: a write cut short
            bad.append(f"line {number}: cut short")
            continue
        try:
            raw = loads_json(line, f"{path}:{number}")
        except InputError as e:
            bad.append(f"line {number}: {e}")
            continue
        if (wrong := problem(raw)) is not None:
            bad.append(f"line {number}: {wrong}")
            continue
        records.append(raw)
    if bad:
        warnings.warn(f"ignoring {len(bad)} line(s) of {path} that are not records: {'; '.join(bad[:3])}", stacklevel=3)
    return records


def envelope_problem(raw: Any, schema: int, fields: Iterable[str]) -> str | None:
    """What is wrong with a record's envelope, or None: a JSON object of schema `schema` (or 0:
    written before records had a version, with the same fields) with no field but `fields`.
    Each record's own check then looks at its fields' types."""
    if not isinstance(raw, dict):
        return "not a JSON object"
    if raw.get("schema", 0) not in (0, schema):
        return f"schema {raw.get('schema')!r}, not {schema} (written by another version)"
    if unknown := sorted(set(raw) - set(fields)):
        return f"unknown fields {unknown}"
    return None


def read_status_json(path: Path, problem: Callable[[Any], str | None], limit: int = MAX_RECORD_BYTES) -> Any | None:
    """A status file's JSON, or None when there is none (yet) or it is not one: unreadable,
    or `problem(raw)` says what is wrong. Not one is warned about, naming the file, and read
    as absent: its writer's next write replaces it."""
    try:
        raw = read_json(path, limit=limit)
    except InputError as e:
        warnings.warn(f"ignoring {path}: {e}", stacklevel=3)
        return None
    if raw is not None and (wrong := problem(raw)) is not None:
        warnings.warn(f"ignoring {path}: {wrong}", stacklevel=3)
        return None
    return raw


def private_temp_dir(prefix: str) -> Path:
    """A new folder of this user's only (0700) in the temporary directory, named for this
    process (`<prefix><pid>-<random>`), after removing this user's folders of the prefix whose
    process is gone: a process killed outright cannot remove its own, and sockets, tickets
    and scripts would pile up there run after run."""
    base = Path(tempfile.gettempdir())
    for old in base.glob(f"{prefix}*-*"):
        pid = old.name[len(prefix):].split("-", 1)[0]
        try:
            if pid.isdigit() and old.lstat().st_uid == os.getuid() and not _process_exists(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            continue
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    return True


# --- SQLite stores in WAL mode (MLflow's, a study's) -----------------------------------------------

SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")  # what SQLite keeps beside a store: its write-ahead log and its index, a rollback journal


def copy_as_new(source: Path, path: Path) -> bool:
    """`path` made a copy of `source` where there is no file yet: copied under another name in
    its folder (which must exist), then linked in, never over a file another process made
    meanwhile. True when it was made here."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def drop_sqlite_companions(path: str | Path) -> None:
    """Before a new store is made at `path`: what one deleted by hand left beside it goes, so
    SQLite never replays an old write-ahead log into the new file."""
    for suffix in SQLITE_COMPANIONS:
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def commit_to_wal(conn) -> None:
    """`conn` (sqlite3) commits into a write-ahead log, synced at its checkpoints rather than at
    every commit (a rollback journal made, synced and deleted per commit: a trial's MLflow run
    opened and closed took 16.2 ms against 11.0, bench/store_commits.py). A crash of the machine may lose the last commits, never the file's consistency;
    readers no longer wait for the writer. A store held otherwise by another process stays as it is."""
    import sqlite3

    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
    except sqlite3.Error:
        pass
