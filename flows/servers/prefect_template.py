"""A new Prefect database copied from one Prefect migrated, and no migration check where none is due.

A Prefect server on a new SQLite database runs every schema migration since Prefect's first
(alembic, over a hundred): 6.8 s alone here, and a folder's first launch waited for it (12.6 s
to the first step against 5.6 s the next time). On a migrated database it still loads every
migration script to learn that nothing is to be done: 0.6 s of every server's start, on the
way to a cold launch's first step. Both are the same work for one Prefect version, so Prefect
does it once per version, on a template in the cache folder (`prefect server database upgrade`,
its own command), and each server process, before it imports Prefect:

- copies the template to its database file when there is none yet (never over one another
  process made meanwhile);
- turns the migrations at start off when its database is at the template's revision (the
  `alembic_version` table says so), and leaves them on otherwise (a database of an older
  Prefect is migrated as before).

Only a local SQLite file that the environment names is touched (the folder's own database,
flows/servers/prefect_db.py); anything else is Prefect's business, as is any failure here: the
server then makes or checks its database the usual way.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import MutableMapping

from flows.servers.prefect_db import URL_ENV, URL_NAMES, database_file
from training.files import copy_as_new, drop_sqlite_companions

MIGRATE_ENV = "PREFECT_SERVER_DATABASE_MIGRATE_ON_START"
MIGRATE_NAMES = (MIGRATE_ENV, "PREFECT_API_DATABASE_MIGRATE_ON_START")
UPGRADE_TIMEOUT_S = 300


def prepare_database(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Before Prefect is imported in a server's process: the database made from the template
    if there is none, and the migrations at start turned off (in `environ`) if it is at the
    template's revision. True when they were turned off."""
    path = database_file(environ)
    if path is None or any(environ.get(name) for name in MIGRATE_NAMES):  # a user's own choice stays
        return False
    try:
        migrated = template()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            copy_as_new(migrated, path)  # never over a database another process made meanwhile
        if not path.exists() or revisions(path) != revisions(migrated):
            return False
    except (OSError, sqlite3.Error, subprocess.SubprocessError):
        return False
    environ[MIGRATE_ENV] = "false"
    return True


def revisions(path: Path) -> set[str]:
    """The alembic revisions the database is at (empty for a file without the table)."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
        try:
            return {row[0] for row in db.execute("SELECT version_num FROM alembic_version")}
        except sqlite3.OperationalError:  # no such table: not a Prefect database, or an empty file
            return set()


def template() -> Path:
    """The migrated empty database of this Prefect version, made by Prefect's own command the
    first time (one process at a time: the others wait for it, then copy it)."""
    from importlib.metadata import version

    from tasks.mlflow_store import cache_dir

    made = cache_dir() / f"prefect-{version('prefect')}-migrated.db"
    if made.exists():
        return made
    made.parent.mkdir(parents=True, exist_ok=True)
    with open(made.parent / f".{made.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if made.exists():
            return made
        fd, tmp = tempfile.mkstemp(dir=made.parent, prefix=".prefect-template-", suffix=".db")
        os.close(fd)
        os.unlink(tmp)  # Prefect creates the file itself
        try:
            env = {name: value for name, value in os.environ.items() if name not in URL_NAMES}
            subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], check=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**env, URL_ENV: f"sqlite+aiosqlite:///{tmp}"}, timeout=UPGRADE_TIMEOUT_S)
            with contextlib.closing(sqlite3.connect(tmp)) as db:
                db.execute("PRAGMA journal_mode = DELETE")  # one file: its log folded in
            if not revisions(Path(tmp)):
                raise sqlite3.DatabaseError(f"{tmp}: Prefect's upgrade left no alembic revision")
            os.replace(tmp, made)
        finally:
            drop_sqlite_companions(tmp)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return made
