"""The folder's resident Prefect server (flows/servers/resident.py): started once however many
commands race to start it, found by the next ones, replaced when its record is stale, stopped by
`campaign stop-server` and by itself once unused; and a launch that reports to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.leases import process_alive
from test_faults import wait_until

# Ready, the handle has imported what the flow's start imports (while the server booted).
FLOW_START = ("fastapi.encoders", "prefect.flow_engine", "prefect.task_engine")
HANDLE = ("import sys; from pathlib import Path; from flows.servers.resident import Resident; r = Resident(Path('.')); r.ready(); "
          f"print(r.started_here, r.state['pid'], r.state['prefect_api'], all(m in sys.modules for m in {FLOW_START!r}))")


def resident_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "CAMPAIGN_SERVER": "on", **extra}
    env.pop("PREFECT_API_URL", None)
    return env


def command(folder: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HANDLE], cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def answer(process: subprocess.Popen) -> tuple[bool, int, str]:
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err
    started, pid, api, imported = out.split()
    assert imported == "True", f"ready without {FLOW_START} imported"
    return started == "True", int(pid), api


@pytest.fixture
def folder(tmp_path, prefect_database):
    prefect_database(tmp_path / ".campaign" / "prefect")  # migrated: the test waits for no migration
    yield tmp_path
    from flows.servers.resident import stop

    stop(tmp_path)


@pytest.mark.slow
def test_one_server_for_racing_commands_found_by_the_next_stopped_on_request(folder):
    racing = [command(folder, resident_env()) for _ in range(2)]
    answers = [answer(p) for p in racing]
    assert answers[0][1:] == answers[1][1:], answers  # one server for both
    pid, api = answers[0][1:]
    assert process_alive(pid, None) and json.loads((folder / ".campaign" / "server.json").read_text())["prefect_api"] == api
    assert answer(command(folder, resident_env())) == (False, pid, api)  # found, not started
    stopped = subprocess.run([sys.executable, "-m", "flows.cli", "stop-server"], cwd=folder, env=resident_env(),
                             capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0 and f"pid {pid}" in stopped.stdout, stopped.stdout + stopped.stderr
    assert not process_alive(pid, None) and not (folder / ".campaign" / "server.json").exists()
    again = subprocess.run([sys.executable, "-m", "flows.cli", "stop-server"], cwd=folder, env=resident_env(),
                           capture_output=True, text=True, timeout=60)
    assert "no Prefect server runs for this folder" in again.stdout


@pytest.mark.slow
def test_a_stale_record_is_replaced_and_an_unused_server_stops_by_itself(folder):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (folder / ".campaign" / "server.json").write_text(json.dumps(
        {"pid": int(dead), "uid": os.getuid(), "prefect_api": "http://127.0.0.1:9/api", "prefect_url": "http://127.0.0.1:9"}))
    started, pid, api = answer(command(folder, resident_env(CAMPAIGN_SERVER_IDLE_S="1")))
    assert started and pid != int(dead) and api != "http://127.0.0.1:9/api"  # a crashed server's record: replaced
    # Its one client has exited: a second later the server stops by itself, and its record goes with it.
    wait_until(lambda: not process_alive(pid, None), 60, "the unused server did not stop")
    assert not (folder / ".campaign" / "server.json").exists()


def test_a_launch_without_a_resident_server_starts_a_temporary_one_when_told(monkeypatch, tmp_path):
    from flows.cli import _prefect_server
    from flows.servers.warmup import WarmUp

    monkeypatch.setenv("CAMPAIGN_SERVER", "off")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # a server of the user's: nothing started
    monkeypatch.chdir(tmp_path)
    assert isinstance(_prefect_server(), WarmUp) and not (tmp_path / ".campaign").exists()


@pytest.mark.slow
def test_campaign_ui_serves_from_the_folders_server_and_leaves_it_running(folder):
    """`campaign ui` adds the MLflow UI beside the folder's resident Prefect server (started for
    it if none runs), and a launch reports there; Ctrl-C stops the MLflow UI, not the server."""
    import signal

    import yaml

    (folder / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "ui"}, "data": {"path": "digits.npz"}, "model": {"name": "mlp", "width": 8},
        "training": {"steps": 2, "batch_size": 8, "lr": 0.1},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": "runs"}}))
    errors = folder / "ui.err"  # a file, not a pipe nobody reads while the test reads its output
    with open(errors, "w") as stderr:
        ui = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "params.yaml"], cwd=folder, env=resident_env(),
                              stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    try:
        lines = []
        for line in ui.stdout:  # until it says it serves (or exits)
            lines.append(line)
            if "Ctrl-C" in line:
                break
        assert lines and "Ctrl-C stops the MLflow" in lines[-1], "".join(lines) + errors.read_text()
        server = json.loads((folder / ".campaign" / "server.json").read_text())
        shown = json.loads((folder / ".campaign" / "ui.json").read_text())
        assert shown["prefect_api"] == server["prefect_api"] and shown["mlflow_url"]  # one Prefect server for the folder
        ui.send_signal(signal.SIGINT)
        out, _ = ui.communicate(timeout=60)
        assert ui.returncode == 0 and "stopped the MLflow UI" in out, out + errors.read_text()
    finally:
        if ui.poll() is None:
            ui.kill()
    assert process_alive(server["pid"], None)  # the folder's server stays for its launches
    assert answer(command(folder, resident_env())) == (False, server["pid"], server["prefect_api"])
