"""The project folder's resident Prefect server: started by the first `campaign launch` (or
`resume`) of a folder, found by the next ones, so that a launch no longer boots a server of its
own (3–8 s of a short campaign on a small host), the way Bazel, Gradle and a Ray head keep theirs.

- One per folder and user: `.campaign/server.json` names it, `.campaign/server.lock` is held
  (flock) by its process for its whole life, so two launches racing to start one get one.
- On loopback, in a session of its own (it outlives the command that started it), its
  database in the folder (`.campaign/prefect/`, unless PREFECT_HOME says where): the folder's
  campaigns, and only they, show in its UI.
- It stops by itself once no command has used it for `CAMPAIGN_SERVER_IDLE_S` (30 minutes by
  default) and none uses it now (each command that reports to it leaves a file naming its
  process in `.campaign/server-clients/` while it runs), and at `campaign stop-server`.
- A command finds it only if its process lives and its API answers within a second: a stale
  record (a crashed server) is replaced, and a command never waits on a dead one. A crash of the
  server loses nothing: the campaign's records on disk are the truth, and a later launch resumes.
- `CAMPAIGN_SERVER=off`: every launch starts a temporary server of its own, as before.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from cluster.leases import process_alive
from training.files import read_json, write_json_atomic

FOLDER = Path(".campaign")
STATE, LOCK, CLIENTS, USED, LOG = "server.json", "server.lock", "server-clients", "server-used", "server.log"
SERVER_ENV = "CAMPAIGN_SERVER"  # "off": no resident server, a temporary one per launch
IDLE_ENV = "CAMPAIGN_SERVER_IDLE_S"
DEFAULT_IDLE_S = 1800.0
START_TIMEOUT_S = 90.0
CHECK_EVERY_S = 1.0


def enabled() -> bool:
    return os.environ.get(SERVER_ENV, "on").lower() not in ("off", "0", "false", "no")


def idle_s() -> float:
    try:
        return max(1.0, float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S)))
    except ValueError:
        return DEFAULT_IDLE_S


def _answers(api: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def find(folder: Path) -> dict | None:
    """The folder's resident server, if its process lives, is this user's, and its API answers."""
    state = read_json(folder / FOLDER / STATE)
    if not isinstance(state, dict) or not isinstance(state.get("pid"), int) or not isinstance(state.get("prefect_api"), str):
        return None
    if state.get("uid") != os.getuid() or not process_alive(state["pid"], None):
        return None
    return state if _answers(state["prefect_api"]) else None


def start(folder: Path, port: int) -> subprocess.Popen:
    """Start the folder's resident server on `port`, detached (it outlives this process); it
    exits at once if another holds the folder's lock."""
    root = folder / FOLDER
    root.mkdir(parents=True, exist_ok=True)
    # Without the launch's marks (CAMPAIGN_WARDEN_MARK, CAMPAIGN_TRIAL_MARK): its warden ends
    # every process the launch leaves behind that carries them, and this one is meant to outlive it.
    env = {k: v for k, v in os.environ.items()
           if k != "PREFECT_API_URL" and not (k.startswith("CAMPAIGN_") and k.endswith("_MARK"))}
    with open(root / LOG, "ab") as log:  # not this command's output: `dvc repro` waits for that to close
        return subprocess.Popen([sys.executable, "-m", "flows.servers.resident", str(folder.resolve()), str(port)], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=folder)


def wait_for(folder: Path, process: subprocess.Popen | None, timeout_s: float = START_TIMEOUT_S) -> dict:
    """The folder's resident server once it answers (the one `process` starts, or the one that
    won the race to the lock); RuntimeError, naming the log, if none does in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (state := find(folder)) is not None:
            return state
        code = process.poll() if process is not None else None
        if code not in (None, 0):
            break
        if code == 0:  # it lost the race to the lock: the winner's record comes, unless it is another user's
            other = read_json(folder / FOLDER / STATE)
            if isinstance(other, dict) and other.get("uid") not in (None, os.getuid()):
                raise RuntimeError(f"another user's Prefect server serves {folder.resolve()}; set {SERVER_ENV}=off to start one "
                                   "of your own for each launch")
        time.sleep(0.05)
    raise RuntimeError(f"the project's Prefect server did not come up (see {folder / FOLDER / LOG}); `campaign stop-server` "
                       f"and launch again, or set {SERVER_ENV}=off to start a temporary one for each launch")


class Resident:
    """A launch's handle on the folder's resident server, as flows.servers.warmup.WarmUp is on a
    temporary one: found, or started to boot while the launch checks its spec (PREFECT_API_URL
    is set at once, to the port it is given), and waited for by `ready`."""

    def __init__(self, folder: Path):
        from flows.servers.warmup import free_port

        self.folder, self.process = folder, None
        self.state = find(folder)
        if self.state is None:
            port = free_port()
            self.process = start(folder, port)
            os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
        else:
            os.environ["PREFECT_API_URL"] = self.state["prefect_api"]
            from tasks.spares import offered_by

            offered_by(folder)  # its spare hub and zygote may be taken (tasks/spares.py)
        register_client(folder)

    @property
    def started_here(self) -> bool:
        return self.process is not None

    def ready(self) -> None:
        from flows.servers.warmup import import_flow_start

        import_flow_start()  # what the flow's start imports, while the server boots (as WarmUp does)
        if self.state is None:
            self.state = wait_for(self.folder, self.process)
        os.environ["PREFECT_API_URL"] = self.state["prefect_api"]  # the race's winner, if not ours

    def flow_settings(self):
        """The server outlives the launch: the flow sends its run's heartbeats (flows/run/heartbeat.py)."""
        from flows.run.heartbeat import engine_heartbeats_off

        return engine_heartbeats_off()


def register_client(folder: Path) -> None:
    """This process uses the folder's server until it exits: the server does not stop for idleness meanwhile."""
    clients = folder / FOLDER / CLIENTS
    clients.mkdir(parents=True, exist_ok=True)
    mine = clients / str(os.getpid())
    mine.write_text(str(os.getpid()))
    _touch(folder / FOLDER / USED)

    def unregister() -> None:
        mine.unlink(missing_ok=True)
        _touch(folder / FOLDER / USED)  # idle from now

    atexit.register(unregister)


def _touch(path: Path) -> None:
    try:
        path.touch()
    except OSError:
        pass


def stop(folder: Path, grace_s: float = 20.0) -> dict | None:
    """Stop the folder's resident server (SIGTERM, then SIGKILL after `grace_s`); its record, or None if none ran."""
    state = read_json(folder / FOLDER / STATE)
    if not isinstance(state, dict) or not isinstance(state.get("pid"), int) or not process_alive(state["pid"], None):
        (folder / FOLDER / STATE).unlink(missing_ok=True)
        return None
    os.kill(state["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while process_alive(state["pid"], None):
        if time.monotonic() > deadline:
            os.killpg(state["pid"], signal.SIGKILL)
            break
        time.sleep(0.05)
    return state


def live_clients(folder: Path) -> list[int]:
    pids = []
    for path in (folder / FOLDER / CLIENTS).glob("*"):
        try:
            pid = int(path.name)
        except ValueError:
            continue
        if process_alive(pid, None):
            pids.append(pid)
        else:
            path.unlink(missing_ok=True)  # a client killed outright
    return pids


def _idle_for(folder: Path) -> float:
    try:
        return time.time() - (folder / FOLDER / USED).stat().st_mtime
    except OSError:
        return float("inf")


def serve(folder: Path, port: int) -> int:
    """The resident server's own process: hold the lock, run Prefect's server as a child, keep
    the record, stop when idle or told to."""
    from training.process import die_with_parent

    root = folder / FOLDER
    root.mkdir(parents=True, exist_ok=True)
    lock = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another one serves the folder
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_UI_API_URL": f"{url}/api", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port)}
    env.setdefault("PREFECT_HOME", str((root / "prefect").resolve()))  # the folder's own database
    child = subprocess.Popen([sys.executable, "-m", "flows.servers.warmup", "--host", "127.0.0.1", "--port", str(port)],
                             env=env, stdin=subprocess.DEVNULL, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _: stopping.append(s))
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(f"{url}/api"):
        if child.poll() is not None or stopping or time.monotonic() > deadline:
            child.terminate()
            return 1
        time.sleep(0.1)
    _touch(root / USED)
    write_json_atomic(root / STATE, {"pid": os.getpid(), "uid": os.getuid(), "prefect_api": f"{url}/api", "prefect_url": url,
                                     "started": time.time(), "idle_s": idle_s(), "prefect_home": env["PREFECT_HOME"]})
    limit = idle_s()
    from tasks.spares import Spares

    spares = Spares(folder)  # the launches' hub and zygote, imported ahead (tasks/spares.py)
    try:
        while not stopping and child.poll() is None:
            clients = live_clients(folder)
            if not clients and _idle_for(folder) > limit:
                break
            spares.tend(launch_running=bool(clients))
            time.sleep(CHECK_EVERY_S)
    finally:
        (root / STATE).unlink(missing_ok=True)  # before the server goes: no command is sent to a dying one
        spares.stop()
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=15)  # it closes its database
            except subprocess.TimeoutExpired:
                child.kill()
    return 0


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1]), int(sys.argv[2])))
