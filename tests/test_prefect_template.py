"""A server's new Prefect database is a copy of one Prefect migrated; no migration check where none is due."""

from __future__ import annotations

import json
import sqlite3
import urllib.request
from pathlib import Path

import pytest

from conftest import wait_for
from flows.servers.prefect_db import URL_ENV
from flows.servers.prefect_template import (
    MEMO_ENV,
    MIGRATE_ENV,
    block_types,
    blocks_mark_file,
    memo_file,
    prepare_database,
    revisions,
    template,
)


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
    assert env[MEMO_ENV] == str(memo_file(database)) and block_types(database) == block_types(migrated) != []
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
    # Its block types are the template's, not written again at its start (each write stamps
    # `updated`): its memo, beside the database, said they were in.
    assert block_types(database) == block_types(migrated)
    assert memo_file(database).read_text().startswith("block_auto_registration = ")


SEED = ("from flows.servers.prefect_template import prepare_database, seed_block_memo; prepare_database(); "
        "import prefect.server.api.server; print(seed_block_memo())")


def seeds(tmp_path: Path, env: dict[str, str]) -> bool:
    """seed_block_memo's answer in a server's process on a new database (the template copied in)."""
    import os
    import subprocess
    import sys

    own = {name: value for name, value in os.environ.items() if not name.startswith(("PREFECT_API_", "PREFECT_SERVER_"))}
    done = subprocess.run([sys.executable, "-c", SEED], env={**own, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


def test_a_new_database_has_no_block_memo_where_its_block_types_are_not_the_templates(tmp_path, migrated):
    import shutil

    # A collection installed since the template was made: the block types a server would write
    # are not the ones in the template, so its start writes them, as without the template.
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copyfile(migrated, cache / migrated.name)
    blocks_mark_file(cache / migrated.name).write_text("another set of block types\n")
    database = tmp_path / "other" / "prefect.db"
    assert not seeds(tmp_path, {"CAMPAIGN_CACHE_DIR": str(cache), URL_ENV: url(database)})
    assert database.exists() and not memo_file(database).exists()
    # With the template's own mark, the same process writes the memo.
    shutil.copyfile(blocks_mark_file(migrated), blocks_mark_file(cache / migrated.name))
    database = tmp_path / "same" / "prefect.db"
    assert seeds(tmp_path, {"CAMPAIGN_CACHE_DIR": str(cache), URL_ENV: url(database)})
    assert memo_file(database).exists()


def test_a_users_own_memo_is_kept(tmp_path, migrated):
    env = {URL_ENV: url(tmp_path / "prefect.db"), "PREFECT_MEMO_STORE_PATH": str(tmp_path / "mine.toml")}
    prepare_database(env)
    assert MEMO_ENV not in env
    (tmp_path / "mine.toml").write_text("block_auto_registration = \"theirs\"\n")
    assert not seeds(tmp_path, {URL_ENV: url(tmp_path / "second.db"), "PREFECT_MEMO_STORE_PATH": str(tmp_path / "mine.toml")})
    assert (tmp_path / "mine.toml").read_text() == "block_auto_registration = \"theirs\"\n"


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
