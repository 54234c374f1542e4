"""A new SQLite MLflow store, copied from an empty one that MLflow itself made.

MLflow makes a new SQLite store by creating its tables and then running every schema
migration since its first release (alembic, ~60 of them): 1.5 s of CPU at the first launch
in a folder, and in every test's fresh store. The result is the same file every time for
one MLflow version, so it is made once per version (by MLflow, in the cache folder) and
copied. Its default experiment is deleted from the template: MLflow creates it again when
it opens the copy, with this store's own artifact location and time.

A store that exists is never touched, nor one that is not a local SQLite file.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
from pathlib import Path

from training.files import copy_as_new, drop_sqlite_companions

CACHE_ENV = "CAMPAIGN_CACHE_DIR"  # the folder of the campaign's caches (default ~/.cache/campaign)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "campaign")


def sqlite_file(uri: str) -> Path | None:
    """The file of a `sqlite:///` URI (relative to the working folder, or absolute with four
    slashes); None for any other store and for an in-memory one."""
    if not uri.lower().startswith("sqlite:///"):
        return None
    path = uri.split(":///", 1)[1].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def make_from_template(uri: str) -> bool:
    """Create the store of `uri` from the template when it is a SQLite file that does not
    exist yet (its folder does); True when it was made here. Any failure leaves the store
    to MLflow, which makes it the slow way."""
    path = sqlite_file(uri)
    if path is None or path.exists() or not path.parent.is_dir():
        return False
    try:
        drop_sqlite_companions(path)
        return copy_as_new(_template(), path)  # never over a store another process made meanwhile
    except (OSError, sqlite3.Error):
        return False


def _template() -> Path:
    from importlib.metadata import version

    template = cache_dir() / f"mlflow-{version('mlflow')}-empty.db"
    if template.exists():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=template.parent, prefix=".mlflow-template-", suffix=".db")
    os.close(fd)
    os.unlink(tmp)  # MLflow creates the file itself (an existing empty file is not a store)
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        store = SqlAlchemyStore(f"sqlite:///{tmp}", str(template.parent / "mlruns"))
        store.engine.dispose()
        with contextlib.closing(sqlite3.connect(tmp)) as db:
            db.execute("DELETE FROM experiment_tags")
            db.execute("DELETE FROM experiments")
            db.commit()
            # One file, whatever mode this process's stores are kept in (tasks.tracking: WAL):
            # the log is folded in and removed, so the file moved below is the whole template.
            db.execute("PRAGMA journal_mode = DELETE")
        os.replace(tmp, template)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return template


def fold_log(uri: str) -> None:
    """Fold the store's write-ahead log into its file (tasks.tracking keeps its SQLite stores in
    WAL mode): at rest the store's file holds all of it, as a person who copies or moves it
    expects. Without waiting for anyone (a process exiting must not hold up the next launch's
    writes): what a reader keeps from folding is folded by the last connection to close, or
    the next checkpoint. Nothing if it is not a local SQLite store."""
    path = sqlite_file(uri)
    if path is None or not path.exists():
        return
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=0)) as db:
            db.execute("PRAGMA wal_checkpoint(PASSIVE)")
    except sqlite3.Error:
        pass
