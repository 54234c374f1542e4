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

The same holds for Prefect's block types: a server writes every one it knows into its database
at start (0.5-0.8 s), unless the memo it keeps says the same ones went into the same database
before. That memo is one file in PREFECT_HOME holding one database's mark, so a folder's
first server, and every server of folders used in turn, registered them again. So the template
has them registered too (the mark of what went in kept beside it), each database has a memo
of its own beside it, and a server whose database was just copied from the template writes
that memo once Prefect is imported (`seed_block_memo`), in Prefect's own form, when the block
types it would write are the template's.

Only a local SQLite file that the environment names is touched (the folder's own database,
flows/servers/prefect_db.py); anything else is Prefect's business, as is any failure here: the
server then makes or checks its database, and writes its block types, the usual way.
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

CODE_ROOT = Path(__file__).resolve().parents[2]  # where `flows` is: the processes started here import from it

MIGRATE_ENV = "PREFECT_SERVER_DATABASE_MIGRATE_ON_START"
MIGRATE_NAMES = (MIGRATE_ENV, "PREFECT_API_DATABASE_MIGRATE_ON_START")
MEMO_ENV = "PREFECT_SERVER_MEMO_STORE_PATH"
MEMO_NAMES = (MEMO_ENV, "PREFECT_MEMO_STORE_PATH")
MEMO_KEY = "block_auto_registration"  # Prefect's key in its memo (prefect/server/api/server.py)
UPGRADE_TIMEOUT_S = 300


def prepare_database(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Before Prefect is imported in a server's process: the database made from the template
    if there is none, its own block memo beside it, and the migrations at start turned off (in
    `environ`) if it is at the template's revision. True when they were turned off."""
    path = database_file(environ)
    if path is None:
        return False
    if not any(environ.get(name) for name in MEMO_NAMES):  # a user's own choice stays
        environ[MEMO_ENV] = str(memo_file(path))
    if any(environ.get(name) for name in MIGRATE_NAMES):
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


def memo_file(database: Path) -> Path:
    """Where a server on `database` keeps Prefect's memo of its block types: beside it."""
    return database.with_name(f"{database.name}.memo.toml")


def blocks_mark_file(template_path: Path) -> Path:
    """Beside the template: the mark of the block types registered in it."""
    return template_path.with_name(f"{template_path.name}.blocks")


def block_types_marks(*database_urls: str) -> list[str | None]:
    """Prefect's mark of the block types its server would write into each of `database_urls`
    (as its memo computes it: the registered Block classes, the collections' block data, the
    URL), the classes and data read once."""
    import json
    from hashlib import sha256

    import prefect.plugins
    from prefect.blocks.core import Block
    from prefect.server.models.block_registration import COLLECTIONS_BLOCKS_DATA_PATH
    from prefect.utilities.dispatch import get_registry_for_type
    from prefect.utilities.hashing import hash_objects

    prefect.plugins.load_prefect_collections()  # as Prefect's memo does, before it reads the registry
    data = json.loads(Path(COLLECTIONS_BLOCKS_DATA_PATH).read_text(encoding="utf-8"))
    registry = get_registry_for_type(Block)
    return [hash_objects(registry, data, url, hash_algo=sha256) for url in database_urls]


def seed_block_memo() -> bool:
    """Once Prefect is imported in a server's process: where its database has no memo yet and
    holds the template's block types as the template got them (a copy nothing rewrote), the
    memo says they are in, when they are the ones this server would write (else Prefect writes
    them at start, as always). True when the memo was written."""
    try:
        from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_MEMO_STORE_PATH

        database, memo = database_file(os.environ), Path(PREFECT_MEMO_STORE_PATH.value())
        if database is None or memo.exists() or not database.exists():
            return False
        made = template()
        registered = blocks_mark_file(made).read_text(encoding="utf-8").strip()
        if not registered or block_types(database) != block_types(made):
            return False
        unbound, mark = block_types_marks("", PREFECT_API_DATABASE_CONNECTION_URL.value())
        if unbound != registered or mark is None:
            return False
        memo.write_text(f'{MEMO_KEY} = "{mark}"\n', encoding="utf-8")
        memo.chmod(0o600)  # as Prefect makes it
        return True
    except Exception:  # noqa: BLE001 - any failure leaves Prefect to write its block types, as without the template
        return False


def block_types(path: Path) -> list[tuple]:
    """The block types in a database, with when each was written (empty where it has none)."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
        try:
            return sorted(db.execute("SELECT id, slug, updated FROM block_type"))
        except sqlite3.OperationalError:
            return []


def revisions(path: Path) -> set[str]:
    """The alembic revisions the database is at (empty for a file without the table)."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
        try:
            return {row[0] for row in db.execute("SELECT version_num FROM alembic_version")}
        except sqlite3.OperationalError:  # no such table: not a Prefect database, or an empty file
            return set()


def template() -> Path:
    """The migrated empty database of this Prefect version, its block types registered, made by
    Prefect's own command and code the first time (one process at a time: the others wait for
    it, then copy it)."""
    from importlib.metadata import version

    from tasks.mlflow_store import cache_dir

    made = cache_dir() / f"prefect-{version('prefect')}-template.db"
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
            registered = subprocess.run([sys.executable, "-m", "flows.servers.prefect_template", tmp], check=True,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        env=env, timeout=UPGRADE_TIMEOUT_S, text=True, cwd=CODE_ROOT).stdout.strip()
            with contextlib.closing(sqlite3.connect(tmp)) as db:
                db.execute("PRAGMA journal_mode = DELETE")  # one file: its log folded in
            if not revisions(Path(tmp)):
                raise sqlite3.DatabaseError(f"{tmp}: Prefect's upgrade left no alembic revision")
            blocks_mark_file(made).write_text(registered + "\n", encoding="utf-8")  # before the template: never one without it
            os.replace(tmp, made)
        finally:
            drop_sqlite_companions(tmp)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return made


def register_block_types(database: str) -> str | None:
    """Prefect's block types written into the template at `database`, as its server writes them
    at start; their mark (block_types_marks, no URL) returned."""
    import asyncio

    os.environ[URL_ENV] = f"sqlite+aiosqlite:///{database}"
    from prefect.server.database import provide_database_interface
    from prefect.server.models.block_registration import run_block_auto_registration

    async def register() -> None:
        session = await provide_database_interface().session()
        async with session:
            await run_block_auto_registration(session=session)

    asyncio.run(register())
    return block_types_marks("")[0]


if __name__ == "__main__":  # template(): python -m flows.servers.prefect_template DATABASE
    print(register_block_types(sys.argv[1]) or "")
