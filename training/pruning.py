"""Early stopping through Optuna's pruners: what the flow and the trainer share.

The flow owns the study (tasks/search.py); each trial's rank 0 reports its metric at every
evaluation and asks the pruner whether to stop (`Pruning.should_stop`). Both build the
pruner from the same plain dict (`TrialConfig.pruning`), so they agree on the rule.
The study is an Optuna journal next to the campaign's trials (`storage`).
"""

from __future__ import annotations

import fcntl
import functools
import math
import os
import sys
import threading
from typing import Any

LEARNS_FROM_FINISHED = {"median"}  # rules whose decision depends on which trials have finished


def storage(path: str):
    """Optuna's journal storage on the campaign's study file: an append-only log of the
    study's changes that each process replays into memory, reading only what was appended
    since its last read. A pruned trial's report and check (on the way from its end to the
    next trial's first step) took 0.7 ms with it and 12.9 ms through Optuna's SQLite storage,
    whose every read goes through SQLAlchemy's ORM (bench/store_commits.py). One per process
    and study (a warm worker's trials report through the same): a study deleted and made
    again under the same path is a new one, which this process has not replayed."""
    first = _first_entry(path)
    return _storage(path, first) if first else _storage.__wrapped__(path, None)


def _first_entry(path: str) -> bytes | None:
    """The journal's first line, whole: the study's creation, which names the storage that
    made it (a random id of Optuna's). The file's inode is no identity: a file made after
    another was deleted often gets the same one."""
    try:
        with open(path, "rb") as f:
            line = f.readline()
    except FileNotFoundError:
        return None
    return line if line.endswith(b"\n") else None


@functools.cache
def _storage(path: str, _first: bytes | None):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    lock = _FileLock(path)
    _drop_torn_end(path, lock)
    return JournalStorage(JournalFileBackend(path, lock_obj=lock))


def _drop_torn_end(path: str, lock: "_FileLock") -> None:
    """A journal whose last entry was cut off (the machine stopped during its write) ends
    without a newline; the next entry would be appended to that line and make the whole
    journal unreadable. The cut entry is dropped: a crash loses at most the last change."""
    lock.acquire()
    try:
        with open(path, "rb+") as f:
            kept = f.read()  # a study's journal: kilobytes to a few megabytes, replayed whole anyway
            if kept and not kept.endswith(b"\n"):
                f.truncate(kept.rfind(b"\n") + 1)
    finally:
        lock.release()


class _FileLock:  # what JournalFileBackend asks of its `lock_obj`: acquire, release
    """The writers' lock of a study's journal: flock(2) on the journal itself, which the kernel
    lets go of when its holder dies. (Optuna's own locks are files that a killed writer leaves
    behind: every later writer waited out their grace period, 30 s.) Readers take no lock:
    they read whole lines only."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._threads = threading.Lock()  # flock excludes open files, not threads sharing one
        self._fd: int | None = None

    def acquire(self) -> bool:
        self._threads.acquire()
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        try:
            if fd is not None:
                os.close(fd)  # the flock goes with its last descriptor
        finally:
            self._threads.release()


def import_storage() -> None:
    """Import what a study's storage uses (Optuna, ~0.35 s, and its journal), by making one on
    a file of its own: the resident server's spare launch and zygote do, so that neither a
    search's first study nor a worker's first report pays it."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        _storage.__wrapped__(os.path.join(folder, "import"), None)


def build_pruner(rule: str | None, min_steps: int = 1, reduction_factor: int = 3, max_steps: int | None = None):
    """The Optuna pruner for an `early_stopping.rule` (None: never prune)."""
    import optuna

    if rule is None:
        return optuna.pruners.NopPruner()
    if rule == "asha":  # asynchronous successive halving: rungs at min_steps * factor^k
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_steps, reduction_factor=reduction_factor)
    if rule == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=min_steps, max_resource=max_steps or "auto", reduction_factor=reduction_factor)
    if rule == "median":  # below the median of earlier trials at the same step
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=max(0, min_steps - 1))
    raise ValueError(f"unknown early-stopping rule {rule!r}")


class Pruning:
    """Rank 0's side: report the metric at an evaluation, learn whether the trial should stop."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self._trial = None

    def _optuna_trial(self):
        if self._trial is None:
            import optuna

            study = optuna.load_study(study_name=self.spec["study"], storage=storage(self.spec["storage"]),
                                      pruner=build_pruner(self.spec["rule"], self.spec["min_steps"],
                                                          self.spec["reduction_factor"], self.spec["max_steps"]))
            self._trial = optuna.trial.Trial(study, self.spec["trial_id"])
        return self._trial

    def should_stop(self, step: int, metrics: dict[str, float]) -> bool:
        import optuna

        value = metrics.get(self.spec["metric"])
        if value is None:
            return False
        trial = self._optuna_trial()
        try:
            trial.report(value, step)
        except optuna.exceptions.UpdateFinishedTrialError:
            # The study was told this trial's end already and it runs again: its result was
            # refused (training.result) after it was pruned, whose state at the stop is not
            # kept, so it trains again from its last save. Pruned then, it stops here again.
            return trial.study.trials[trial.number].state == optuna.trial.TrialState.PRUNED
        return step >= self.spec["min_steps"] and trial.should_prune()

    def finished(self, result: dict[str, Any]) -> None:
        """Tell the study a finished trial's objective, after its result is written and before
        its device goes to the next trial. The median rule compares only with finished trials:
        told by the campaign's loop alone, a trial staged behind this one could reach its first
        check before the loop has collected this one, and be judged against fewer trials than
        it should. The loop's own tell then finds it told (skip_if_finished). The other rules
        compare with every trial's reports, finished or not, and leave the tell to the loop."""
        if self.spec["rule"] not in LEARNS_FROM_FINISHED or result.get("pruned"):
            return
        value = result.get("metrics", {}).get(self.spec["metric"])
        if value is None or not math.isfinite(float(value)):
            return  # the loop tells it failed
        try:
            trial = self._optuna_trial()
            trial.study.tell(trial, float(value), skip_if_finished=True)
        except Exception as e:  # the trial is finished all the same: the loop tells the study as it collects it
            print(f"early stopping: telling the study this trial's end failed ({type(e).__name__}: {e}); the campaign tells it",
                  file=sys.stderr, flush=True)
