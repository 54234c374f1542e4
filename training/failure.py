"""How a trial's process failed, said in the user's terms: `failure.json` in the trial's folder.

A trial process that ends on an exception writes, before it exits, what the exception was
(its type, one line for people, where it was raised) and whose code raised it:

- `user code`: the user's own code (the model, data, loss, optimizer or training function):
  the innermost frame that is not the Python library or an installed package (torch) is
  outside this project's packages, or in a package a target of the trial names. A retry
  would raise it again after as many steps: the campaign does not retry it.
- `disk full`: a write found no room (ENOSPC, EDQUOT: training.files.DiskFull). Not retried
  either: it would fill the disk again.
- `project`: this project's code or a library it called (a peer gone, a collective's error,
  a lease problem): an infrastructure failure, retried once from the last checkpoint.
- `signal`: a worker ended by a signal, written by its launcher (training/launch.py for
  torchrun's workers, the elastic agent for its own): retried (the campaign tells an
  out-of-memory kill apart, tasks/trial.py).

The first failure of a segment is the one kept: when one rank raises, the others fail after
it (their peer gone, a collective broken), and it is the first that says why. The campaign
removes the file before each launch, so what it reads is this segment's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import sys
import sysconfig
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

from training.files import DiskFull, disk_full_in, envelope_problem, no_room, read_status_json, write_atomic
from training.layout import trial_files
from training.manifest import TMP_PREFIX

SCHEMA = 1
USER, DISK_FULL, PROJECT, SIGNAL = "user code", "disk full", "project", "signal"
NOT_RETRIED = (USER, DISK_FULL)  # a retry would fail the same way
LINE_CHARS = 400  # one line for a table's reason and a log line: the whole traceback is in train.log

_HERE = Path(__file__).resolve().parent.parent
# The project's own packages: a frame there is ours (an error there is an infrastructure failure).
_PROJECT = tuple(str(_HERE / name) + os.sep for name in ("training", "tasks", "cluster", "flows"))
# Python's library and installed packages (torch, numpy...): skipped when looking for whose code raised.
_LIBRARY = tuple(sorted({str(Path(p).resolve()) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
                         if (p := sysconfig.get_paths().get(key))}))


@dataclass(frozen=True)
class Failure:
    """`failure.json`: how one process of a trial's segment failed."""

    kind: str  # USER, DISK_FULL, PROJECT or SIGNAL
    line: str  # for people: "IndexError: index 10 is out of bounds ... (labwork/nets.py:31, in forward)"
    type: str = ""  # the exception's class name ("" for a signal)
    where: str | None = None  # file:line, in function: the frame that decided whose code it was
    rank: int | None = None
    pid: int | None = None
    signal: int | None = None  # SIGNAL: the signal's number
    time: float = 0.0
    schema: int = SCHEMA

    @property
    def retried(self) -> bool:
        return self.kind not in NOT_RETRIED


# --- whose code raised ---------------------------------------------------------------------------


def user_packages(targets: Iterable[str | None]) -> frozenset[str]:
    """The top-level packages of the trial's targets ("labwork.nets:make" -> "labwork"): a frame
    in one is the user's even where their package is installed among the libraries."""
    names = {t.partition(":")[0].split(".")[0] for t in targets if t}
    return frozenset(names - {"training", "tasks", "cluster", "flows", "torch", ""})


def targets_of(config: Any) -> list[str | None]:
    """The targets a TrialConfig names (model, data, loss, optimizer, training function)."""
    parts = [config.model, config.data, config.loss, config.optimizer, config.function]
    return [p.get("target") for p in parts if isinstance(p, dict)]


def _whose(filename: str, module: str | None, users: frozenset[str]) -> str | None:
    """USER or PROJECT for a frame; None for the library's (skipped)."""
    if module and module.split(".")[0] in users:
        return USER
    if not filename or filename.startswith("<"):  # <frozen runpy>, <string>, code torch generated
        return None
    path = os.path.realpath(filename)
    if path.startswith(_PROJECT):
        return PROJECT
    if path.startswith(_LIBRARY):
        return None
    return USER


# torch's DataLoader raises a worker's exception again in the trainer with the worker's
# traceback as text: its frames are where the exception came from.
_ORIGINAL = "Original Traceback (most recent call last):"
_FRAME_TEXT = re.compile(r'^\s*File "(.+?)", line (\d+), in (.+)$', re.MULTILINE)


def _frames(exc: BaseException) -> list[tuple[str, int, str, str | None]]:
    """(file, line, function, module) of the frames `exc` went through, innermost last."""
    frames = [(f.f_code.co_filename, line, f.f_code.co_name, f.f_globals.get("__name__"))
              for f, line in traceback.walk_tb(exc.__traceback__)]
    text = str(exc)
    if _ORIGINAL in text:
        frames += [(m.group(1), int(m.group(2)), m.group(3).strip(), None) for m in _FRAME_TEXT.finditer(text.split(_ORIGINAL, 1)[1])]
    return frames


def _shown(filename: str) -> str:
    relative = os.path.relpath(filename) if not filename.startswith("<") else filename
    return filename if relative.startswith("..") else relative


def whose(exc: BaseException, users: frozenset[str] = frozenset()) -> tuple[str, str | None]:
    """(USER or PROJECT, where) for an exception: decided by its innermost frame outside the
    library; an exception of ours raised from one of the user's (`raise ... from`) is the user's."""
    for filename, line, function, module in reversed(_frames(exc)):
        if (kind := _whose(filename, module, users)) is not None:
            if kind == PROJECT and exc.__cause__ is not None and whose(exc.__cause__, users)[0] == USER:
                return USER, whose(exc.__cause__, users)[1]
            return kind, f"{_shown(filename)}:{line}, in {function}"
    return PROJECT, None


def exception_line(exc: BaseException) -> str:
    """The exception's line as a traceback ends with it: `IndexError: index 10 is out of bounds
    for dimension 0 with size 10` (the first line of a message of several; a DataLoader worker's
    exception's own line, not torch's "Caught IndexError in DataLoader worker process 0.")."""
    text = str(exc).strip()
    if _ORIGINAL in text:
        return text.splitlines()[-1].strip()[:LINE_CHARS]
    first = text.splitlines()[0].strip() if text else ""
    return (f"{type(exc).__name__}: {first}" if first else type(exc).__name__)[:LINE_CHARS]


def _log_of_this_process() -> str | None:
    """The file this process's output goes to (a trial's train.log), if it is one."""
    try:
        target = os.readlink("/proc/self/fd/1")
    except OSError:
        return None
    return target if target.startswith("/") and Path(target).is_file() else None


def describe(exc: BaseException, rank: int | None = None, users: frozenset[str] = frozenset(),
             trial_dir: str | Path | None = None) -> Failure:
    """What `exc` says to the person who runs the trial (see the module's doc)."""
    now, pid = time.time(), os.getpid()
    if (cause := no_room(exc)) is not None:
        # A write to the log itself (a print) names no file: the log is what this process writes to.
        full = disk_full_in(exc, None if cause.filename else _log_of_this_process() or trial_dir)
        return Failure(DISK_FULL, str(full)[:2 * LINE_CHARS], type(full).__name__, full.path, rank, pid, None, now)
    kind, where = whose(exc, users)
    line = exception_line(exc) + (f" ({where})" if where else "")
    return Failure(kind, line, type(exc).__name__, where, rank, pid, None, now)


# --- signals -------------------------------------------------------------------------------------


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_description(code: int) -> str:
    """An exit code in words: a negative one is the signal that ended the process."""
    return f"killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"


def signal_failure(signum: int, rank: int | None = None, pid: int | None = None) -> Failure:
    """A worker ended by `signum`, as its launcher saw it."""
    who = " ".join(part for part in (f"rank {rank}" if rank is not None else "", f"(pid {pid})" if pid else "") if part)
    return Failure(SIGNAL, f"{who + ' ' if who else ''}killed by {signal_name(signum)}", "", None, rank, pid, signum, time.time())


# --- the file ------------------------------------------------------------------------------------


def _problem(raw: Any) -> str | None:
    if (wrong := envelope_problem(raw, SCHEMA, Failure.__dataclass_fields__)) is not None:
        return wrong
    if raw.get("kind") not in (USER, DISK_FULL, PROJECT, SIGNAL) or not isinstance(raw.get("line"), str):
        return "no kind or line"
    if any(raw.get(k) is not None and (not isinstance(raw[k], int) or isinstance(raw[k], bool)) for k in ("rank", "pid", "signal")):
        return "a rank, pid or signal that is not a whole number"
    return None


def read_failure(trial_dir: str | Path) -> Failure | None:
    """The segment's first failure, or None (none written, or not one: warned)."""
    raw = read_status_json(trial_files(trial_dir).failure, _problem)
    return None if raw is None else Failure(**{**raw, "schema": SCHEMA})


def clear_failure(trial_dir: str | Path) -> None:
    """Before a launch: what the file says from then on is the new segment's."""
    trial_files(trial_dir).failure.unlink(missing_ok=True)


def write_failure(trial_dir: str | Path, failure: Failure) -> bool:
    """Keep `failure` unless the segment already has one (the first says why); True if kept.
    Never raises: the process is failing already (a full disk may refuse even this; then the
    campaign goes by the exit code)."""
    path = trial_files(trial_dir).failure
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        write_atomic(aside, (json.dumps(asdict(failure), indent=2, sort_keys=True) + "\n").encode(), durable=False)
        try:
            os.link(aside, path)  # atomic and refused if there is one: the first failure stays
            return True
        except FileExistsError:
            return False
        finally:
            aside.unlink(missing_ok=True)
    except OSError as e:
        print(f"could not record the failure in {path} ({e.strerror}): {failure.line}", file=sys.stderr, flush=True)
        return False


@contextlib.contextmanager
def failures_recorded(trial_dir: str | Path, rank: int | None, users: frozenset[str] = frozenset()) -> Iterator[None]:
    """An exception out of the block is recorded (`failure.json`), then goes on: its traceback
    still reaches the trial's log, once. An exit (SystemExit, Ctrl-C) is not a failure."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:
        failure = describe(e, rank, users, trial_dir)
        if failure.kind == DISK_FULL and (half := _half_written_checkpoint(trial_dir)) is not None:
            failure = _checkpoint_filled_the_disk(failure, half, e)
        write_failure(trial_dir, failure)
        raise


def _half_written_checkpoint(trial_dir: str | Path) -> Path | None:
    """The checkpoint being written when the disk filled up (a `.tmp-` folder), if any."""
    return max(trial_files(trial_dir).checkpoints.glob(f"{TMP_PREFIX}*"), default=None)


def _checkpoint_filled_the_disk(failure: Failure, half: Path, exc: BaseException) -> Failure:
    """A save in the background fills the disk; the training thread's next write (a log line,
    a metric) may find no room first. The checkpoint is what took the room: the failure names it,
    and its half-written folder (never in view; a resume removes it anyway) is removed, so that
    the failure record has room."""
    cause = no_room(exc)
    full = DiskFull(half, cause.errno if cause is not None and cause.errno else errno.ENOSPC, "the checkpoint ")
    shutil.rmtree(half, ignore_errors=True)
    return replace(failure, line=str(full)[:2 * LINE_CHARS], where=full.path)

