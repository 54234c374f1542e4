"""A server's new Prefect database is a copy of one Prefect migrated; no migration check where none is due."""

from __future__ import annotations

import json
import sqlite3
import urllib.request
from pathlib import Path

import pytest

from conftest import wait_for
from flows.servers.prefect_db import URL_ENV
from flows.servers.prefect_template import MIGRATE_ENV, prepare_database, revisions, template


@pytest.fixture
def migrated(prefect_database) -> Path:
    """This process's template (the conftest fixture put it in the process's cache folder)."""
    return template()


def url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


def answers(health: str) -> bool:
    try:
        with urllib.request.urlopen(health, timeout=1) as response:
            return response.status == 200
    except OSError:  # not listening yet
        return False


def test_a_new_database_is_the_template_and_its_server_answers_without_migrating(tmp_path, migrated):
    import os
    import subprocess
    import sys

    from flows.servers.warmup import free_port

    database = tmp_path / "folder" / ".campaign" / "prefect" / "prefect.db"
    env = {URL_ENV: url(database)}
    assert prepare_database(env) is True
    assert env[MIGRATE_ENV] == "false" and revisions(database) == revisions(migrated) != set()
    # A real server on it, as the folder's resident server runs one (it prepares its database
    # itself, finds it made, and skips the migrations): it serves Prefect's API on that file.
    port = free_port()
    own = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_API_")}  # no other server's
    server = subprocess.Popen([sys.executable, "-m", "flows.servers.warmup", "--host", "127.0.0.1", "--port", str(port)],
                              env={**own, URL_ENV: url(database), "PREFECT_HOME": str(tmp_path / "home")},
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        api = f"http://127.0.0.1:{port}/api"
        wait_for(lambda: server.poll() is not None or answers(f"{api}/health"), 120, "the server's first answer")
        assert server.poll() is None
        request = urllib.request.Request(f"{api}/flows/", data=json.dumps({"name": "made-here"}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status in (200, 201) and json.load(response)["name"] == "made-here"
    finally:
        server.terminate()
        server.wait(timeout=30)
    with sqlite3.connect(database) as db:
        assert [row[0] for row in db.execute("SELECT name FROM flow")] == ["made-here"]


def test_a_database_at_another_revision_is_migrated_at_start_as_before(tmp_path, migrated):
    database = tmp_path / "prefect.db"
    database.write_bytes(migrated.read_bytes())
    with sqlite3.connect(database) as db:
        db.execute("UPDATE alembic_version SET version_num = 'an-older-one'")
    env = {URL_ENV: url(database)}
    assert prepare_database(env) is False and MIGRATE_ENV not in env
    assert revisions(database) == {"an-older-one"}  # left for Prefect to migrate


def test_a_file_another_process_made_is_never_replaced(tmp_path, migrated):
    database = tmp_path / "prefect.db"
    database.write_bytes(b"")  # made meanwhile, empty: Prefect makes its tables, as before
    env = {URL_ENV: url(database)}
    assert prepare_database(env) is False and MIGRATE_ENV not in env
    assert database.read_bytes() == b""


@pytest.mark.parametrize("env", [
    {URL_ENV: "postgresql+asyncpg://user@db/prefect"},  # not a file of ours
    {"PREFECT_API_DATABASE_CONNECTION_URL": "sqlite+aiosqlite:///:memory:"},
    {},  # Prefect's default, or a user's profile: Prefect's business
])
def test_a_database_that_is_not_a_named_sqlite_file_is_left_to_prefect(tmp_path, migrated, env):
    given = dict(env)
    assert prepare_database(env) is False and env == given


def test_a_users_own_migration_setting_stays(tmp_path, migrated):
    env = {URL_ENV: url(tmp_path / "prefect.db"), "PREFECT_API_DATABASE_MIGRATE_ON_START": "true"}
    assert prepare_database(env) is False and MIGRATE_ENV not in env
    assert not (tmp_path / "prefect.db").exists()
