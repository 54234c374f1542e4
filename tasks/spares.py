"""Processes the folder's resident server keeps ready for its launches, their imports done.

A launch's first step waits on three processes that each import for a second or more on a
small host: the launch itself (Prefect and the flow: ~0.9 s before its checks can end; torch
for the check of a function it has not checked, ~1 s; Optuna and its storage for a search), the
campaign's MLflow hub (tasks/tracking_hub.py: MLflow, ~1.5 s of CPU) and the zygote its warm
workers are forked from (training/zygote.py: torch and the trainer, ~2.3 s). With the launch's
own work that is more CPU than two cores have in two seconds. So the resident server
(flows/servers/resident.py) keeps one of each ready, a *spare*: started while no launch of the
folder runs (or while one does, on a host with cores to spare: `may_make`), it imports what the
process it will become imports, then waits on a Unix socket (an abstract one, of a random name:
nothing on disk to leave behind) named by `.campaign/spare-<kind>.json` (and
`spare-<kind>.ready` once its imports are done: the project's files it imported, with their
size and time before it did).

A spare is never used up: each claim is served by a copy of it, forked (~15 ms here), its
imports shared with the spare's pages (each page the copy writes is copied then: a warm
launch's first step ~0.04-0.1 s later here than with the spare itself serving it), and the
spare offers itself again at once. So a launch right after another (a `resume` right after a killed launch, a relaunch
after an edit of the spec) finds all three ready, and no launch costs the CPU of making them
again. Below, "the spare" that serves a claim is that copy.

The spare launch is taken by the `campaign launch` (or `resume`) command as it starts
(`run_command`): the command's process hands it its terminal (stdin, stdout, stderr), its
arguments, environment and start time, and stays as the command's face, passing Ctrl-C and
SIGTERM on and exiting with the code the spare says last; if it is killed, the spare kills
itself (their socket closes), so the campaign ends as a killed launch does. The spare runs the
command as `flows.cli` would, Prefect's settings and logging made again from the command's
environment and terminal (`in_spare`).

A launch that reports to the resident server takes a spare (`claim`): it renames that record
(one launch at a time: the spare writes it again once it has forked), checks that the spare
runs its interpreter, the project's code as it is on disk now (the files it imported, by size
and time, and the site folders'; the whole project's while it still imports) and its
environment (`env_digest`, but for what differs between any two launches), hands it the
descriptors the process it replaces would have been started with, that process's environment
and the launch's folder and cores, and is told the pid of the copy that serves it. That copy
then leaves the server's session (a server that stops does not take a campaign's hub with it)
and becomes that process: `python -m tasks.tracking_hub` or `python -m
training.zygote`, exactly, on those descriptors. A spare still importing is taken all the
same (the claim waits for its imports to end, as it would for a process just started); where
the code changed while it imported, its copy becomes the process by exec instead, importing
afresh, and the spare ends.

The zygote's workers are found by the marks in their environment as the kernel shows it
(/proc/<pid>/environ: the process's environment at its start, inherited by a fork), which a
spare started before the launch cannot have: it is started with placeholders of the marks'
length, which the copy that serves a launch writes over with the launch's marks (its own pages:
the spare keeps its placeholders) before its first fork (else it execs, as above).

While they wait the three hold ~0.9 GB of memory (resident: ~390 MB the launch, ~220 MB the
hub, ~310 MB the zygote), most of it shared with the copies serving a launch; they are made
once (~7 s of CPU), and again only when a launch finds one stale or it dies
(`CAMPAIGN_SPARES=off`: the server keeps none; a launch with it set takes none).

Nothing is lost if a spare dies: the launch's hub calls then run in the launch (HubGone), its
workers start on their own (ZygoteGone), as when their own processes die.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from training.files import read_json, write_json_atomic
from training.zygote import Zygote, load

FOLDER = Path(".campaign")
ROOT = Path(__file__).resolve().parents[1]  # the repository: tasks/ is in it
PACKAGES = ("cluster", "flows", "tasks", "training")
# What each spare imports: what its process imports before it serves.
KINDS = {
    # (`module:function`: imported, then called: matplotlib's pyplot on its Agg backend, which
    # the pictures drawn as a campaign ends need; imported during the campaign, it competed
    # with the hub's first calls for its CPU.)
    "hub": ("tasks.tracking_hub", "tasks.tracking", "tasks.curves", "tasks.timeline", "tasks.system_metrics", "mlflow",
            "mlflow.store.tracking.sqlalchemy_store", "tasks.timeline:import_matplotlib"),
    # (A pruned trial's first report loads Optuna and its study's storage: 0.4 s of each worker's
    # first such trial, on the way from its end to the next trial's first step, when the zygote
    # had not; 0.7 s with the study in SQLite.)
    "zygote": ("tasks.warm_worker", "training.pruning:import_storage"),
    # `campaign launch` itself (Prefect, the flow, the checks, the live view, a search's study): not flows.cli,
    # whose consoles look at the terminal as they are made, imported once the launch's are its own.
    "launch": ("typer", "rich.console", "rich.table", "rich.live", "flows.run.campaign", "flows.run.live_view",
               "flows.servers.resident", "flows.servers.warmup", "flows.servers.warmup:import_flow_start", "flows.servers.ui", "optuna",
               "training.pruning:import_storage",
               "training.function"),  # torch, for the check of a function trial the launch has not checked before
}
LAUNCH_COMMANDS = ("launch", "resume")  # what a spare launch runs: the commands that run a campaign's flow
# The marks the launch's processes carry (flows/run/warden.py, tasks/trial.py): 16 hex digits each.
MARKS = ("CAMPAIGN_WARDEN_MARK", "CAMPAIGN_TRIAL_MARK")
PLACEHOLDER = "0" * 16
# What differs between two launches of one folder and matters to no import: the server they
# report to (and whether to use spares), the launch's marks, its hub's socket, the shell's
# bookkeeping, what torch sets for itself once it has run (its compiler's cache: read when used).
VOLATILE = {"PREFECT_API_URL", "CAMPAIGN_METRICS_SOCKET", "CAMPAIGN_SERVER", "CAMPAIGN_SPARES", "PYTORCH_NVML_BASED_CUDA_CHECK",
            "TORCHINDUCTOR_CACHE_DIR", "_", "PWD", "OLDPWD", "SHLVL", "COLUMNS", "LINES", *MARKS}
SPARES_ENV = "CAMPAIGN_SPARES"  # "off": the resident server keeps none
STATE, READY = "spare-{}.json", "spare-{}.ready"
# How long a claim waits for the spare to say which process serves it (a fork: milliseconds; a
# spare still importing answers once its imports are done).
CLAIM_ANSWER_S = 120.0


def enabled() -> bool:
    return os.environ.get(SPARES_ENV, "on").lower() not in ("off", "0", "false", "no")


def code_files() -> dict[str, list[int]]:
    """Every module file of the project, and the interpreter's site folders (a package
    installed or removed changes their time): path -> [size, time]."""
    import site

    found = {}
    for path in [*site.getsitepackages(), *(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))]:
        try:
            stat = os.stat(path)
        except OSError:
            continue
        found[str(path)] = [stat.st_size, stat.st_mtime_ns]
    return found


def unchanged(files: dict[str, list[int]]) -> bool:
    """Whether each file is as `files` has it (size and time)."""
    for path, seen in files.items():
        try:
            stat = os.stat(path)
        except OSError:
            return False
        if [stat.st_size, stat.st_mtime_ns] != seen:
            return False
    return True


def fingerprint(files: dict[str, list[int]] | None = None) -> str:
    return hashlib.sha256(json.dumps([sys.executable, sorted((files if files is not None else code_files()).items())]).encode()).hexdigest()


def env_digest(env: dict[str, str]) -> str:
    """The environment but for VOLATILE and Prefect's settings (the CLI sets some; neither MLflow nor torch reads them)."""
    kept = sorted((k, v) for k, v in env.items() if k not in VOLATILE and not k.startswith("PREFECT_"))
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()


def state_path(folder: Path, kind: str) -> Path:
    return folder / FOLDER / STATE.format(kind)


def ready(folder: Path, kind: str) -> int | None:
    """The pid of the folder's spare of `kind` if its imports are done (it may be taken already)."""
    record = _ready_record(folder, kind)
    return record["pid"] if record is not None else None


def _ready_record(folder: Path, kind: str) -> dict | None:
    """What a spare says once its imports are done: its pid, and the files it imported with
    their size and time when it started (and the site folders'), to be checked before it is taken."""
    try:
        record = read_json(folder / FOLDER / READY.format(kind))
    except Exception:  # noqa: BLE001
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) and isinstance(record.get("files"), dict) else None


# --- the resident server's side -------------------------------------------------------------


def start(folder: Path, kind: str) -> subprocess.Popen:
    """A spare of `kind` for `folder`, in the server's session; it dies with the server until taken."""
    env = dict(os.environ)
    if kind == "zygote":  # the environment block its workers inherit: the marks' room
        env.update({mark: PLACEHOLDER for mark in MARKS})
    with open(folder / FOLDER / "server.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "tasks.spares", kind, str(folder.resolve())], env=env, cwd=folder,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


def may_make(launch_running: bool, cores: int, load: float) -> bool:
    """Whether the server makes a missing spare now: while no launch of the folder runs, or
    while one does on a host with cores to spare for their imports (each is a process importing
    for seconds): the cores the server may use, less the host's load average, leave one more
    than there are spares. So the first launch of a folder on a GPU host (its server started
    by it) is followed by spares even if it is stopped and resumed at once; on a small host,
    where they would slow the campaign's own processes, they wait for it to end."""
    return not launch_running or cores - load >= len(KINDS) + 1


class Spares:
    """The resident server's spares: one of each kind, started where there is none (never
    made, ended by a launch as stale, or died) when `may_make` says so, given up on after
    repeated failures to start."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.procs: dict[str, subprocess.Popen] = {}
        self.failures = dict.fromkeys(KINDS, 0)

    def tend(self, launch_running: bool) -> None:
        make = may_make(launch_running, len(os.sched_getaffinity(0)), os.getloadavg()[0])
        for kind in KINDS:
            proc = self.procs.get(kind)
            if proc is not None and proc.poll() is None:
                continue
            if proc is not None:  # ended: stale (killed by a launch, or exited once it had served), or failed
                self.failures[kind] = 0 if proc.returncode in (0, -signal.SIGKILL) else self.failures[kind] + 1
                del self.procs[kind]
                _remove_state(self.folder, kind, proc.pid)
            if make and self.failures[kind] < 3 and enabled():
                self.procs[kind] = start(self.folder, kind)

    def stop(self) -> None:
        """The spares end. What they served runs on: the copies are not theirs, nor a spare that
        could not fork and served a launch itself (its record no longer names it; a spare caught
        between a claim and its record dies with the server all the same, its parent-death signal)."""
        for kind, proc in self.procs.items():
            if proc.poll() is None and (_state(self.folder, kind) or {}).get("pid") == proc.pid:
                proc.kill()
                proc.wait()
            _remove_state(self.folder, kind, proc.pid)


def _state(folder: Path, kind: str) -> dict | None:
    try:
        state = read_json(state_path(folder, kind))
    except Exception:  # noqa: BLE001 (junk: none)
        return None
    return state if isinstance(state, dict) and isinstance(state.get("pid"), int) else None


def _remove_state(folder: Path, kind: str, pid: int) -> None:
    """An ended spare's records."""
    state = _state(folder, kind)
    if state is None or state["pid"] == pid:
        state_path(folder, kind).unlink(missing_ok=True)
    if ready(folder, kind) in (None, pid):
        (folder / FOLDER / READY.format(kind)).unlink(missing_ok=True)


# --- the launch's side -----------------------------------------------------------------------

_folder: Path | None = None  # the folder whose resident server this launch reports to
_in_spare = False  # this process is a spare launch running a command (it hands it to no other)


def in_spare() -> bool:
    """Whether this process is a spare launch running the command: it imported before the
    command's environment was its own (Prefect's settings are read again from it)."""
    return _in_spare


def offered_by(folder: Path | None) -> None:
    """This process reports to `folder`'s resident server: it may take that server's spares."""
    global _folder
    _folder = folder


def claim(kind: str, fds: list[int], request: dict) -> int | None:
    """Hand `fds` and `request` to the folder's spare of `kind`: its pid, now the process the
    request asks for; None (nothing done) where there is no spare this process may take."""
    if _folder is None or not enabled():
        return None
    path = state_path(_folder, kind)
    taken = path.with_name(f"{path.name}.{os.getpid()}")
    try:
        os.rename(path, taken)  # one launch takes it
    except OSError:
        return None
    try:
        state = read_json(taken)
    except Exception:  # noqa: BLE001
        state = None
    if not isinstance(state, dict) or not isinstance(state.get("pid"), int) or state.get("uid") != os.getuid() \
            or not isinstance(state.get("socket"), str):
        taken.unlink(missing_ok=True)
        return None
    from tasks import timings

    if state.get("env") != env_digest(dict(os.environ)):  # another environment's: left for a launch in that one
        os.replace(taken, path)
        timings.mark(f"the resident server's spare {kind} not taken: it was made in another environment")
        return None
    taken.unlink(missing_ok=True)
    done = _ready_record(_folder, kind)
    if done is not None and done["pid"] != state["pid"]:
        done = None
    # Ready: the files it imported are as they were; still importing: the whole project is.
    if state.get("python") != sys.executable or not (unchanged(done["files"]) if done else state.get("fingerprint") == fingerprint()):
        _end(state)  # the server makes another once idle
        timings.mark(f"the resident server's spare {kind} not taken: the project's code changed since it was made")
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect("\0" + state["socket"])
            if _peer(s) != (state["pid"], os.getuid()):  # the name is not the spare's (it died, another took the name)
                raise OSError(f"the socket {state['socket']} is not the spare's")
            socket.send_fds(s, [json.dumps({**request, "cwd": os.getcwd(), "affinity": sorted(os.sched_getaffinity(0))}).encode()],
                            fds)
            s.settimeout(CLAIM_ANSWER_S)
            pid = json.loads(s.recv(1 << 10))["pid"]  # the process forked to serve it (nothing: the spare died)
    except (OSError, KeyError, TypeError, ValueError) as e:
        _end(state)
        timings.mark(f"the resident server's spare {kind} not taken: {e.__class__.__name__}: {e}")
        return None
    timings.mark(f"the resident server's spare {kind} taken ({'its imports done' if done else 'still importing'})")
    return pid


def run_command(folder: Path, argv: list[str]) -> int | None:
    """Run the command `argv` (`campaign launch ...`) in the folder's spare launch, on this
    process's terminal: its exit code, once it has exited; None (nothing done) where no spare
    may take it, or where the spare's imports were stale (this process runs it then).

    This process stays as the command's face: Ctrl-C and SIGTERM are passed on to the spare,
    which stops its campaign as the command would; if this process is killed, the spare kills
    itself (the warden then ends what it left, as for a killed launch)."""
    from tasks.timings import process_started_at

    if _in_spare:
        return None
    started_at, at = process_started_at(), time.time()
    global _folder
    _folder = folder
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = claim("launch", [0, 1, 2, theirs.fileno()], {"argv": argv, "launch_env": dict(os.environ), "started_at": started_at,
                                                          "taken_at": at})
    finally:
        theirs.close()
        _folder = None
    if pid is None:
        mine.close()
        return None
    try:
        spare = os.pidfd_open(pid)
    except OSError:  # gone already: it said its code, or died
        spare = -1

    def pass_on(signum, frame) -> None:
        if spare >= 0:
            try:
                signal.pidfd_send_signal(spare, signum)
            except OSError:
                pass

    before = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    with mine:
        try:
            said = mine.recv(1 << 12)  # its exit code, as its last act; nothing if it died without one
        except OSError:
            said = b""
        if spare >= 0:
            select.select([spare], [], [])  # the command is over when its process is
            os.close(spare)
    for sig, handler in before.items():  # (a fallback runs the command here, with Ctrl-C its own again)
        signal.signal(sig, handler)
    answer = json.loads(said) if said else {"code": 1}
    return None if answer.get("fallback") else int(answer["code"])


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def _end(state: dict) -> None:
    """A spare not taken, ended (if its pid is still a spare's: never another process that got
    the number)."""
    try:
        if b"tasks.spares" in Path(f"/proc/{state['pid']}/cmdline").read_bytes():
            os.kill(state["pid"], signal.SIGKILL)
    except OSError:
        pass


class Adopted:
    """A spare this process took, seen as much like a `subprocess.Popen` as its users need
    (pid, stdin, poll, wait, kill): it is not this process's child, so its exit is seen
    through a pidfd and its code is not known (0)."""

    def __init__(self, pid: int, stdin=None):
        self.pid, self.stdin, self.returncode = pid, stdin, None
        try:
            self._fd = os.pidfd_open(pid)  # kept open for the object's life: never a number reused by another file
        except OSError:  # gone already
            self._fd, self.returncode = -1, 0

    def poll(self) -> int | None:
        return self._wait(0)

    def wait(self, timeout: float | None = None) -> int:
        if self._wait(timeout) is None:
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
        return self.returncode

    def _wait(self, timeout: float | None) -> int | None:
        if self.returncode is None and select.select([self._fd], [], [], timeout)[0]:
            self.returncode = 0
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._fd, signal.SIGKILL)
            except OSError:
                pass

    def __del__(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)


def adopt_zygote(cwd: Path, python: str = sys.executable) -> bool:
    """The campaign's zygote of warm workers (tasks/trial.py) is the resident server's spare, if
    one can be taken: True when it is."""
    from tasks.trial import adopt_zygote as adopt

    def take(env: dict[str, str]) -> "AdoptedZygote | None":
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = claim("zygote", [theirs.fileno()], {"serves": str(cwd), "zygote_env": {**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}})
        finally:
            theirs.close()
        if pid is None:
            mine.close()
            return None
        return AdoptedZygote(mine, pid, str(cwd))

    return python == sys.executable and adopt(python, cwd, take)


class AdoptedZygote(Zygote):
    """training.zygote.Zygote on a spare that became the campaign's zygote: the same requests
    and answers on `control`, its process watched through a pidfd."""

    def __init__(self, control: socket.socket, pid: int, serves: str) -> None:  # noqa: super().__init__ starts a process
        self.new_session, self.serves, self.socket = True, serves, control
        self.proc = Adopted(pid)
        self._follow()


# --- the spare's side -----------------------------------------------------------------------


def _write_marks(env: dict[str, str]) -> bool:
    """The launch's marks written over the placeholders of this process's environment block,
    as /proc/<pid>/environ shows it (and a forked child's): False where they cannot be."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50 and 51)
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            block = mem.read(end - start)
            for mark in MARKS:
                value = env.get(mark, PLACEHOLDER)
                old = f"{mark}={PLACEHOLDER}\0".encode()
                at = block.find(b"\0" + old) + 1 if not block.startswith(old) else 0
                if at <= 0 and not block.startswith(old) or len(value) != len(PLACEHOLDER):
                    return False
                mem.seek(start + at + len(mark) + 1)
                mem.write(value.encode())
        shown = Path("/proc/self/environ").read_bytes().split(b"\0")
        return all(f"{mark}={env.get(mark, PLACEHOLDER)}".encode() in shown for mark in MARKS)
    except (OSError, ValueError, IndexError):
        return False


def _take_claim(listener: socket.socket) -> tuple[dict, list[int], socket.socket]:
    """The next request of a process of this user, and its connection, on which the pid of the
    process that serves it is said (another user's connection is closed unread)."""
    while True:
        conn, _ = listener.accept()
        if _peer(conn)[1] != os.getuid():  # any user may connect to an abstract socket: only ours are heard
            conn.close()
            continue
        try:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 8)
        except OSError:
            message, fds = b"", []
        if message:
            return json.loads(message), fds, conn
        conn.close()
        for fd in fds:
            os.close(fd)


def _fork_served() -> bool:
    """Fork the process that serves a claim: True in it, False in the spare, which goes on
    offering itself (it never waits on the copies: SIGCHLD ignored, the kernel reaps them; each
    copy restores the default at once, for its own children). A spare that cannot fork serves
    the claim itself (the server makes another)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        served = os.fork() == 0
    except OSError:
        served = True
    if served:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    return served


def _exec(argv: list[str], env: dict[str, str], fds: list[int]) -> None:
    """Become `python argv` afresh (the spare's imports are stale, or its marks cannot be written)."""
    for fd in fds:
        os.set_inheritable(fd, True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


def _become_hub(request: dict, fds: list[int], fresh: bool) -> None:
    listen, answer, stdin, out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.dup2(stdin, 0)
    for fd in (out, err, stdin):
        os.close(fd)
    argv = ["--listen-fd", str(listen), "--answer-fd", str(answer), *request["args"]]
    if not fresh:
        _exec(["-m", "tasks.tracking_hub", *argv], request["hub_env"], [listen, answer])
    os.environ.clear()
    os.environ.update(request["hub_env"])
    sys.stdin = open(0, "r", encoding="utf-8", closefd=False)
    from tasks.tracking_hub import main

    main(argv)


def _become_zygote(request: dict, fds: list[int], fresh: bool) -> None:
    (control,) = fds
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # as a zygote started by a launch: its output, and its workers', to /dev/null
        os.dup2(null, fd)
    os.close(null)
    env = request["zygote_env"]
    if not fresh or not _write_marks(env):
        _exec(["-m", "training.zygote", "--fd", str(control), "--for", request["serves"], *(a for m in KINDS["zygote"] for a in ("--preload", m))], env,
              [control])
    os.environ.clear()
    os.environ.update(env)
    from training.zygote import serve

    serve(socket.socket(fileno=control), KINDS["zygote"])


def _become_launch(request: dict, fds: list[int], fresh: bool) -> None:
    """Run the launch's command in this process, on its terminal, in its environment; its exit
    code goes to the launch's process (run_command) once everything else has ended."""
    import atexit
    import threading
    import traceback

    import tasks.spares as named  # this module under its name, as the command imports it (this one runs as __main__)

    named._in_spare = True
    stdin, out, err, channel = fds
    launch = socket.socket(fileno=channel)
    if not fresh:  # its imports are stale: the launch runs the command itself
        launch.send(json.dumps({"fallback": True}).encode())
        os._exit(0)
    for fd, to in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, to)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["launch_env"])
    sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1 if os.isatty(1) else -1, closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from tasks import timings

    timings.handed_over(request["started_at"], [("the resident server's spare launch taken (its imports done)", request["taken_at"])])
    exiting = threading.Event()

    def launch_gone() -> None:  # its process was killed: so is this one, as the launch would have been
        try:
            while launch.recv(16):
                pass
        except OSError:
            pass
        if not exiting.is_set():
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=launch_gone, name="launch-watch", daemon=True).start()
    sys.argv = ["campaign", *request["argv"]]
    code = 1  # an exception that escapes the command: Python's own exit code
    try:
        importlib.import_module("flows.cli").main()  # by name: the layer above this one
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:  # noqa: BLE001 (said as the interpreter says an uncaught one)
        traceback.print_exc()
    # What the interpreter does at exit, but for its teardown of every module and object: that
    # writes to nearly every page this copy shares with the spare (~0.3 s of copying here), and
    # nothing of the command's is left in it once the threads are joined and the hooks have run.
    threading._shutdown()  # noqa: SLF001 (the interpreter's own first step at exit: non-daemon threads joined)
    atexit._run_exitfuncs()  # noqa: SLF001
    exiting.set()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        launch.send(json.dumps({"code": code}).encode())
    except OSError:
        pass
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    from training.process import die_with_parent, imports_without_gc

    kind, folder = (argv if argv is not None else sys.argv[1:])[:2]
    folder = Path(folder)
    die_with_parent(signal.SIGKILL)  # untaken, it goes with the server
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the process it becomes ends as its own does (its input closing)
    before = code_files()  # the code its imports read
    name = f"campaign-spare-{secrets.token_hex(16)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(8)
    state = {"pid": os.getpid(), "uid": os.getuid(), "kind": kind, "python": sys.executable, "socket": name,
             "fingerprint": fingerprint(before), "env": env_digest(dict(os.environ))}
    write_json_atomic(state_path(folder, kind), state, durable=False)
    if kind == "zygote":  # as a launch's zygote imports (training/launch.py's launch_env, tasks/trial.py)
        os.environ.update({"OMP_NUM_THREADS": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"})
    with imports_without_gc():
        for name in KINDS[kind]:
            load(name)
    loaded = {str(Path(m.__file__).resolve()) for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
    files = {path: seen for path, seen in before.items() if path in loaded or not path.endswith(".py")}
    fresh = unchanged(files)  # else a file changed while it was imported: it execs afresh once taken
    write_json_atomic(folder / FOLDER / READY.format(kind), {"pid": os.getpid(), "files": files}, durable=False)
    while True:  # each claim served by a forked copy of this process, its imports shared; this one stays a spare
        request, fds, conn = _take_claim(listener)
        if _fork_served():
            break
        conn.close()
        for fd in fds:
            os.close(fd)
        if not fresh:  # its imports are stale: the copy it forked execs afresh, and the server makes another spare
            os._exit(0)
        write_json_atomic(state_path(folder, kind), state, durable=False)  # offered again (the claim took the record)
    listener.close()
    with conn:  # the claimant's to watch: this process's pid (a launch's face waits on it, a hub's and a zygote's are adopted)
        try:
            conn.send(json.dumps({"pid": os.getpid()}).encode())
        except OSError:
            os._exit(1)  # the claimant is gone: nothing to serve
    # The launch's now: out of the server's session (its stop must not end a campaign's hub or
    # zygote), not dying with it, in the launch's folder, on the launch's cores.
    os.setsid()
    die_with_parent(0)
    os.chdir(request["cwd"])
    try:
        os.sched_setaffinity(0, request["affinity"])
    except (OSError, KeyError):
        pass
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    if kind == "hub":
        _become_hub(request, fds, fresh)
    elif kind == "launch":
        _become_launch(request, fds, fresh)
    else:
        _become_zygote(request, fds, fresh)


if __name__ == "__main__":
    main()
