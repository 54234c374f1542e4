"""`campaign ui`: a Prefect server and the MLflow UI on 127.0.0.1, for as long as it runs.

Both are the projects' own servers: Prefect's app as `prefect server start` serves it (with
flows.servers.warmup's retries of refused writes) and `mlflow server`, on free loopback ports. The
Prefect UI is pointed at its own API (PREFECT_UI_API_URL). While it runs, `.campaign/ui.json`
in the project folder names the Prefect API, and `campaign launch` from that folder reports
there instead of starting a server, so the runs show up live. The Prefect server keeps its
database where the folder's other servers do (the folder's own: flows/servers/prefect_db.py),
so the folder's campaigns launched before show up too, and no other folder's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from training.files import read_json, write_json_atomic
from training.process import die_with_parent, stop_process_groups
from training.layout import campaign_records

STATE = Path(".campaign") / "ui.json"  # relative to the project folder (where `campaign` runs)
PORTS = Path(".campaign") / "ui-ports.json"  # the ports last used: kept after `campaign ui` stops
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000}  # the tools' own defaults
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Servers:
    prefect_url: str  # the UI; its API is prefect_url + "/api"
    mlflow_url: str | None  # None: the spec tracks to an MLflow server of its own (printed instead)
    processes: tuple[subprocess.Popen, ...]

    @property
    def prefect_api(self) -> str:
        return self.prefect_url + "/api"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def stable_ports(folder: Path, asked: dict[str, int], host: str = "127.0.0.1") -> tuple[dict[str, int], list[str]]:
    """The ports `campaign ui` serves on: the ones asked for, else the ones this folder used
    last (so that links written into Prefect artifacts and MLflow runs keep working after a
    restart), else the tools' defaults (Prefect 4200, MLflow 5000); a busy port gives way to
    a free one, and the notes say so."""
    remembered = read_json(folder / PORTS) or {}
    ports, notes = {}, []
    for name, default in DEFAULT_PORTS.items():
        if asked.get(name):
            ports[name] = asked[name]
            continue
        wanted = remembered.get(name) if isinstance(remembered.get(name), int) else default
        if port_is_free(wanted, host if name == "prefect" else "127.0.0.1"):
            ports[name] = wanted
        else:
            ports[name] = free_port()
            notes.append(f"port {wanted} for {name} is taken: using {ports[name]} (links written with {wanted} point elsewhere)")
    return ports, notes


def remember_ports(folder: Path, servers: "Servers") -> None:
    ports = {"prefect": int(servers.prefect_url.rsplit(":", 1)[1])}
    if servers.mlflow_url:
        ports["mlflow"] = int(servers.mlflow_url.rsplit(":", 1)[1])
    write_json_atomic(folder / PORTS, ports)


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        # A session of its own (stopped as a group), and gone if `campaign ui` is killed outright.
        return subprocess.Popen(command, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))


# MLflow's server starts a job runner beside itself (four huey consumers polling their queue:
# ~26 CPU-s in a two-minute pool test here) for features a campaign never asks of it.
MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def start_servers(tracking_uri: str, logs: Path, prefect_port: int = 0, mlflow_port: int = 0, host: str = "127.0.0.1",
                  prefect_home: Path | None = None, auth_string: str | None = None, prefect_url: str | None = None) -> Servers:
    """Start both servers and wait until they answer; raises RuntimeError (naming the log) if one does not.
    `host`: the Prefect server's address (a pool's nodes must reach it; MLflow stays on loopback).
    `prefect_home`: the Prefect server's own folder (its database) instead of the user's.
    `auth_string`: Prefect's API auth the server then requires (a pool's).
    `prefect_url`: a Prefect server that runs already (the folder's resident one): only MLflow's is started."""
    if prefect_url is not None:
        return _start_mlflow_beside(tracking_uri, logs, mlflow_port, prefect_url)
    prefect_port = prefect_port or free_port()
    prefect_url = f"http://{host}:{prefect_port}"
    env = {"PREFECT_UI_API_URL": prefect_url + "/api", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": "", "PREFECT_SERVER_API_HOST": host, "PREFECT_SERVER_API_PORT": str(prefect_port)}
    if prefect_home is not None:
        env["PREFECT_HOME"] = str(prefect_home)
    if auth_string is not None:  # a pool's server (flows/pool/secret.py): only clients with it are served
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth_string
    processes = [_start([sys.executable, "-m", "flows.servers.warmup", "--host", host, "--port", str(prefect_port)],
                        env, logs / "prefect-server.log")]
    checks = [(prefect_url + "/api/health", logs / "prefect-server.log")]
    mlflow_url = None
    if not tracking_uri.startswith(("http://", "https://")):
        mlflow_port = mlflow_port or free_port()
        mlflow_url = f"http://127.0.0.1:{mlflow_port}"
        processes.append(_start([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                                 "--backend-store-uri", tracking_uri, "--workers", "1"], MLFLOW_SERVER_ENV, logs / "mlflow-server.log"))
        checks.append((mlflow_url + "/health", logs / "mlflow-server.log"))
    servers = Servers(prefect_url, mlflow_url, tuple(processes))
    deadline = time.time() + START_TIMEOUT_S
    for (url, log), process in zip(checks, processes):
        while not healthy(url):
            if process.poll() is not None or time.time() > deadline:
                stop_servers(servers)
                raise RuntimeError(f"{url} did not come up (exit code {process.poll()}); see {log}")
            time.sleep(0.5)
    return servers


def _start_mlflow_beside(tracking_uri: str, logs: Path, mlflow_port: int, prefect_url: str) -> Servers:
    """The MLflow UI alone, beside a Prefect server that runs already."""
    if tracking_uri.startswith(("http://", "https://")):
        return Servers(prefect_url, None, ())
    mlflow_port = mlflow_port or free_port()
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    process = _start([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                      "--backend-store-uri", tracking_uri, "--workers", "1"], MLFLOW_SERVER_ENV, logs / "mlflow-server.log")
    servers = Servers(prefect_url, mlflow_url, (process,))
    deadline = time.time() + START_TIMEOUT_S
    while not healthy(mlflow_url + "/health"):
        if process.poll() is not None or time.time() > deadline:
            stop_servers(servers)
            raise RuntimeError(f"{mlflow_url}/health did not come up (exit code {process.poll()}); see {logs / 'mlflow-server.log'}")
        time.sleep(0.5)
    return servers


def stop_servers(servers: Servers, grace_s: float = 20.0) -> None:
    stop_process_groups([process.pid for process in servers.processes], grace_s)  # each in a session of its own
    for process in servers.processes:
        process.wait()


def write_state(folder: Path, servers: Servers) -> Path:
    path = folder / STATE
    write_json_atomic(path, {"prefect_api": servers.prefect_api, "prefect_url": servers.prefect_url,
                             "mlflow_url": servers.mlflow_url, "pid": os.getpid()})
    return path


def clear_state(folder: Path) -> None:
    (folder / STATE).unlink(missing_ok=True)


def running_ui(folder: Path) -> dict | None:
    """The `campaign ui` of this project folder, if one runs and its Prefect API answers."""
    state = read_json(folder / STATE)
    if not state or not healthy(state["prefect_api"] + "/health"):
        return None
    return state


def mlflow_ui(tracking_uri: str, folder: Path | None = None) -> str | None:
    """Where people open the MLflow UI for this store: the tracking server itself, or the
    `campaign ui` of this folder; None if neither (links are then left out)."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri
    state = read_json((folder or Path.cwd()) / STATE)
    return state.get("mlflow_url") if state else None


def describe(servers: Servers, tracking_uri: str) -> list[str]:
    return [f"Prefect UI  {servers.prefect_url}   (API {servers.prefect_api})",
            f"MLflow UI   {servers.mlflow_url or tracking_uri}" + ("" if servers.mlflow_url else "   (the spec's own server)")]


def reporting_campaigns(runs_dir: Path, prefect_api: str) -> list[str]:
    """Campaigns whose process still runs and reports to this Prefect API, whatever their
    record says (a campaign records its end before its flow run reports it): stopping the
    server now would leave that unreported and fail the launch."""
    from tasks.records import owner_alive, read_campaign_file
    from training.files import InputError

    names = []
    for record_path in campaign_records(runs_dir):
        try:
            record = read_campaign_file(record_path)
        except InputError:  # not a campaign's record: no campaign reports through it
            continue
        if record is not None and record.prefect_api == prefect_api and record.owner and owner_alive(record.owner):
            names.append(record.name)
    return names


def main_loop(servers: Servers, busy=lambda: [], say=print, ready: str | None = None) -> int | None:
    """Wait until a server exits (returns its code) or a signal arrives (returns None).

    `ready` is said once the signals are handled here (a Ctrl-C from then on stops in order).
    On a signal while `busy()` names campaigns that report here, keep serving until they
    end; a second signal stops at once."""
    stop = []
    previous = {s: signal.signal(s, lambda *_: stop.append(s)) for s in (signal.SIGINT, signal.SIGTERM)}
    if ready is not None:
        say(ready)
    told = False
    try:
        while True:
            for process in servers.processes:
                if process.poll() is not None:
                    return process.returncode
            if stop:
                waiting = busy() if len(stop) == 1 else []
                if not waiting:
                    return None
                if not told:
                    say(f"campaign(s) {', '.join(waiting)} still report to this Prefect server: serving until they end "
                        f"(Ctrl-C again to stop now)")
                    told = True
            time.sleep(0.5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

