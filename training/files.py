"""Small files in and out, in one place.

Writes are atomic: a reader sees the old file or the new one, never half of one.
Reads are bounded, whatever the path turns out to be: every file the product reads (the
spec, records, manifests, request.json) goes through `read_bounded`, which takes regular
files only (a FIFO would block, /dev/zero would never end), opens without blocking, reads at
most limit + 1 bytes (a size from stat is not a bound: a file can grow while it is read),
and `loads_json` refuses nesting deeper than a record ever has before the parser recurses.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

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
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(obj, sort_keys=True) + "\n").encode()
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
