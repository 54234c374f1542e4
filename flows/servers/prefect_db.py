"""Each project folder's own Prefect database: `.campaign/prefect/prefect.db`.

Prefect keeps every server's runs in one database under its home (~/.prefect) unless told
otherwise, so every clone's and every project's campaigns showed in each `campaign ui`, and a
folder's flow runs outlived the folder. The `campaign` command points the servers it starts
(the folder's resident server, a launch's temporary one, `campaign ui`'s, the one Prefect starts
by itself for `profile`) at the folder's own file instead: its UI shows the folder's campaigns,
and only they. Set before Prefect reads its settings, through the database URL alone (not
PREFECT_HOME, which would hide the user's Prefect profiles).

A user who says where Prefect lives keeps it: PREFECT_API_URL (a server of theirs: nothing is
started), PREFECT_HOME or Prefect's own database URL. CAMPAIGN_PREFECT_DB (`campaign
--prefect-db`) names the file outright, e.g. ~/.prefect/prefect.db to share Prefect's default
one between folders as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

DB_ENV = "CAMPAIGN_PREFECT_DB"
URL_ENV = "PREFECT_SERVER_DATABASE_CONNECTION_URL"
URL_NAMES = (URL_ENV, "PREFECT_API_DATABASE_CONNECTION_URL")  # the second: the setting's older name
# Where a user said Prefect lives: left as it is (the first is also PREFECT_SERVER_DATABASE_CONNECTION_URL's older name).
USERS_OWN = ("PREFECT_API_URL", "PREFECT_HOME", URL_ENV, "PREFECT_API_DATABASE_CONNECTION_URL")
FOLDER_DB = Path(".campaign") / "prefect" / "prefect.db"  # where the resident server's PREFECT_HOME puts it too


def database_settings(folder: Path, environ: Mapping[str, str], chosen: Path | None = None) -> dict[str, str]:
    """The environment the folder's Prefect servers need (pure): the database `chosen`, else the
    folder's own unless the user already set where Prefect lives; {} to leave it as it is."""
    if chosen is None:
        if any(environ.get(name) for name in USERS_OWN):
            return {}
        chosen = folder / FOLDER_DB
    path = Path(os.path.expanduser(chosen))
    path = path if path.is_absolute() else folder / path
    return {URL_ENV: f"sqlite+aiosqlite:///{path.resolve()}"}


def use_folder_database(folder: Path, chosen: Path | None = None) -> None:
    """Point the Prefect servers this process starts at the folder's database (database_settings)."""
    os.environ.update(database_settings(folder, os.environ, chosen))


def database_file(environ: Mapping[str, str]) -> Path | None:
    """The SQLite file the environment names for Prefect's database; None for any other
    database, an in-memory one, or none named (Prefect's default, or a user's profile)."""
    for name in URL_NAMES:
        url = environ.get(name, "")
        if url:
            if not (url.startswith("sqlite") and ":///" in url):
                return None
            path = url.split(":///", 1)[1].split("?", 1)[0]
            return Path(path) if path and path != ":memory:" else None
    return None


def make_database_folder() -> None:
    """The folder of the SQLite database the environment names, made before a server opens it
    (SQLite makes the file, not its folder); written only by a command that starts a server."""
    path = database_file(os.environ)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
