"""Early stopping through Optuna's pruners: what the flow and the trainer share.

The flow owns the study (tasks/search.py); each trial's rank 0 reports its metric at every
evaluation and asks the pruner whether to stop (`Pruning.should_stop`). Both build the
pruner from the same plain dict (`TrialConfig.pruning`), so they agree on the rule.
The study lives in SQLite next to the campaign's trials: a waiting writer waits, it does
not fail (`storage`).
"""

from __future__ import annotations

import functools
import math
import os
import sqlite3
import sys
from typing import Any

from training.files import commit_to_wal, drop_sqlite_companions

LEARNS_FROM_FINISHED = {"median"}  # rules whose decision depends on which trials have finished
SQLITE_TIMEOUT_S = 60  # trials of one campaign report to one file; a writer waits this long for another


def storage(url: str):
    """Optuna's RDB storage on the campaign's SQLite file: one per process and file (a warm
    worker's trials report through the same; a new one checks the schema: a first report and
    pruning check took 34.6 ms with one, 8.1 ms with the kept one, bench/store_commits.py)."""
    path = url.split(":///", 1)[1] if url.startswith("sqlite:///") else ""
    if not path or path == ":memory:":
        return _storage(url, None)
    try:
        return _storage(url, os.stat(path).st_ino)
    except FileNotFoundError:  # made now: its own, not kept (the next call finds the file)
        return _storage.__wrapped__(url, None)


@functools.cache  # by the file's identity too: a study deleted and made again is a new file
def _storage(url: str, _inode: int | None):
    """Tolerant of concurrent writers (a waiting writer waits), and in WAL mode
    (training.files.commit_to_wal): a trial's report at an evaluation (a pruned trial's last
    one is on the way from its end to the next trial's start) and the campaign's ask and tell
    commit without a journal file each; a resume tells the study the results on disk again."""
    import optuna

    path = url.split(":///", 1)[1] if url.startswith("sqlite:///") else ""
    if not path or path == ":memory:":
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": SQLITE_TIMEOUT_S}})
    if not os.path.exists(path):
        drop_sqlite_companions(path)
    return optuna.storages.RDBStorage(url, engine_kwargs={"creator": functools.partial(_wal_connection, path)})


def _wal_connection(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=SQLITE_TIMEOUT_S, check_same_thread=False)  # SQLAlchemy's pool hands it between threads
    commit_to_wal(conn)
    return conn


def import_storage() -> None:
    """Import what a study's storage uses (SQLAlchemy, Alembic, Optuna's tables: ~0.4 s on top
    of Optuna's own import) by making one in memory: the resident server's spare launch does,
    so that a search's first study is made in a tenth of that."""
    storage("sqlite://")


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
