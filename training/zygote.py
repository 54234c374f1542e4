"""A zygote: one process that imports torch and the trainer once and forks worker processes.

    python -m training.zygote --fd N --preload training.worker

Every worker process of a trial (a campaign's warm worker, an elastic agent's worker)
imported torch and the trainer for itself: ~2 s of CPU each on the kind of host the tests
run on, paid when a campaign starts its first trials or an elastic trial starts or grows,
exactly when the CPU is busiest. A zygote pays it once; a fork is ready in milliseconds.

Protocol, on a SOCK_SEQPACKET socket from the process that started the zygote: a request is
one JSON message `{"module", "args", "env", "cwd", "new_session", "name"}` with up to two file
descriptors; the child runs `module.main(args)` with `{fd0}`/`{fd1}` in `args` replaced by
the numbers the descriptors have in it, or, when the request says `"stdin": true`, the
first descriptor as its standard input. The answer is `{"started": pid}`, and later
`{"exited": pid, "code": c}` when that child ends: the zygote is its parent, so only it can
reap it and know its code. A child's command line is the zygote's (which names what it
serves: `--for`); its process name (`ps -o comm`, /proc/<pid>/comm) is the request's `name`.

Forking is safe here: the zygote has one thread and has not touched CUDA (checked once its
imports are done; it runs nothing else before a fork), so a child starts from a clean state, applies its own environment
(CUDA_VISIBLE_DEVICES, its cores) and only then opens a device. The zygote ignores SIGTERM
and SIGINT (a signal to a trial's process group is for the workers, which may save first)
and ends when the other end of its socket closes: when its starter ends or dies. It then
kills and reaps the children still running; a child whose zygote is killed outright dies
with it too (its parent-death signal).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Sequence

from training.process import die_with_parent, imports_without_gc, name_process


class ZygoteCannotFork(RuntimeWarning):
    """Said once by a zygote's starter when the zygote refuses to fork."""


class ZygoteGone(RuntimeError):
    """The zygote cannot fork (it exited, or refused to start): start the process on its own."""


# --- the zygote's side -------------------------------------------------------------------


def load(name: str) -> None:
    """Import `name`; `module:function`: import the module, then call the function (what its
    import alone leaves for the first use: a storage's first connection, pyplot's backend)."""
    module, _, call = name.partition(":")
    imported = importlib.import_module(module)
    if call:
        getattr(imported, call)()


def serve(control: socket.socket, preload: Sequence[str]) -> None:
    """Import `preload`, then fork a child per request and report each one's exit, until the
    starter closes its end. Never returns (the children must not come back here either)."""
    for name in ("SIGTERM", "SIGINT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    with imports_without_gc():  # frozen before the first fork: the workers' collections skip it all
        for name in preload:
            load(name)
    # Checked once: between forks the zygote runs nothing but this loop.
    problem = _fork_problem()
    wake_read, wake_write = os.pipe()  # SIGCHLD wakes the select below
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([control, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
        for pid in list(children):  # one by one: a status is taken only for a child of ours
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                control.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        if control not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
        if not message:  # the starter is done, or dead: so are its workers, reaped here (their CPU counted to its tree)
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            for pid in children:
                os.waitpid(pid, 0)
            os._exit(0)
        if problem:
            control.send(json.dumps({"refused": problem}).encode())
            os._exit(1)
        pid = os.fork()
        if pid == 0:
            _become(json.loads(message), fds, closing=[control.fileno(), wake_read, wake_write])
        for fd in fds:
            os.close(fd)
        children.add(pid)
        control.send(json.dumps({"started": pid}).encode())


def _fork_problem() -> str | None:
    """Why forking would not be safe now, or None. A CUDA driver loaded here (any CUDA call
    loads it, `torch.cuda.is_available()` included unless NVML answers it) would leave the
    children unable to use their GPUs."""
    if len(os.listdir("/proc/self/task")) > 1:
        return "the zygote has more than one thread"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the zygote has initialised CUDA"
    if "libcuda.so" in Path("/proc/self/maps").read_text():
        return "the zygote has loaded the CUDA driver"
    return None


def _become(request: dict, fds: list[int], closing: list[int]) -> None:
    """The forked child: the requested module's main, as `python -m module args` would run
    it, in the environment and folder asked for. Never returns into the zygote's loop."""
    code = 1
    try:
        if request.get("new_session"):
            os.setsid()
        die_with_parent()  # with the zygote, whatever the module's main does
        signal.set_wakeup_fd(-1)
        for name in ("SIGCHLD", "SIGTERM", "SIGINT"):
            signal.signal(getattr(signal, name), signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
        for fd in closing:
            os.close(fd)
        if request.get("stdin"):
            os.dup2(fds[0], 0)
            os.close(fds[0])
            sys.stdin = open(0, "r", closefd=False)
        if request.get("name"):
            name_process(request["name"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        args = list(request["args"])
        for i, fd in enumerate(fds):
            args = [a.replace(f"{{fd{i}}}", str(fd)) for a in args]
        result = importlib.import_module(request["module"]).main(args)
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        # What the interpreter would do at exit, as `python -m module` would have: the hooks
        # the module registered run (multiprocessing's removes the /tmp/pymp-* folder of a
        # loader's fork server); the zygote registers none of its own.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fork worker processes from one that imported torch and the trainer once.")
    parser.add_argument("--fd", type=int, required=True, help="the SOCK_SEQPACKET socket requests come on")
    parser.add_argument("--preload", action="append", default=[], help="a module to import before the first fork "
                        "(`module:function`: then call it)")
    parser.add_argument("--for", dest="serves", default="", help="what it serves (a trial's config, a campaign's folder): for ps")
    args = parser.parse_args(argv)
    serve(socket.socket(fileno=args.fd), args.preload)


# --- the starter's side ------------------------------------------------------------------


class ForkedProcess:
    """A child of a zygote, seen as much like a `subprocess.Popen` as its users need (pid,
    stdin, poll, wait, kill). Its exit code comes from the zygote, its parent."""

    def __init__(self, zygote: "Zygote", pid: int, stdin=None) -> None:
        self.zygote, self.pid, self.stdin = zygote, pid, stdin

    @property
    def returncode(self) -> int | None:
        return self.zygote.exits.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.zygote.changed:
            if not self.zygote.changed.wait_for(lambda: self.pid in self.zygote.exits, timeout):
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
        return self.zygote.exits[self.pid]

    def kill(self) -> None:
        if self.returncode is None:  # not reaped yet, so the pid is still this child's
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Zygote:
    """A zygote process and the thread that reads its answers. `new_session`: the zygote
    and each child lead sessions of their own (a campaign's warm workers: the campaign stops
    a trial by its process group); else they stay in the starter's (an elastic agent's
    workers: stopping the agent's group stops them). The zygote inherits the starter's
    standard output and error (`output`: else /dev/null), and so do its children."""

    def __init__(self, preload: Sequence[str], cwd: Path, env: dict[str, str], python: str = sys.executable,
                 new_session: bool = False, output: int | None = subprocess.DEVNULL, serves: str = "") -> None:
        self.new_session = new_session
        self.serves = serves or str(cwd)
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [python, "-m", "training.zygote", "--fd", str(theirs.fileno()), "--for", self.serves]
        for module in preload:
            command += ["--preload", module]
        # No parent-death signal: it fires when the *thread* that started a process ends, and
        # the first thread to need a worker starts the zygote. It ends when this socket closes.
        # torch.cuda.is_available() through NVML, not the CUDA driver, should anything imported here ask.
        env = {**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                     pass_fds=(theirs.fileno(),), start_new_session=new_session)
        theirs.close()
        self._follow()

    def _follow(self) -> None:
        """Keep what the zygote says of its children, read on a thread of its own."""
        self.exits: dict[int, int] = {}
        self.children: set[int] = set()
        self.changed = threading.Condition()
        self.started: queue.Queue[int | str] = queue.Queue()
        self.fork_lock = threading.Lock()
        self.gone: str | None = None
        threading.Thread(target=self._read, name="zygote", daemon=True).start()

    def fork(self, module: str, args: list[str], env: dict[str, str], cwd: Path, fds: Sequence[int] = (),
             stdin: bool = False, name: str = "") -> ForkedProcess:
        """A child running `module.main(args)` (`{fd0}`, `{fd1}`: the numbers `fds` get in it;
        `stdin`: the first of them is its standard input; `name`: its process name).
        `ZygoteGone` if no child can come."""
        request = {"module": module, "args": args, "env": env, "cwd": str(cwd), "new_session": self.new_session, "stdin": stdin,
                   "name": name}
        with self.fork_lock:  # one request in flight: each answer is the request's before it
            if self.gone is not None:
                raise ZygoteGone(self.gone)
            try:
                socket.send_fds(self.socket, [json.dumps(request).encode()], list(fds))
            except OSError as e:
                raise ZygoteGone(f"the zygote cannot be reached ({e})") from e
            answer = self.started.get()
        if isinstance(answer, str):
            raise ZygoteGone(answer)
        return ForkedProcess(self, answer)

    def _read(self) -> None:
        while True:
            try:
                message = self.socket.recv(4096)
            except OSError:
                message = b""
            answer = json.loads(message) if message else {}
            if "started" in answer:
                with self.changed:
                    self.children.add(answer["started"])
                self.started.put(answer["started"])
            elif "exited" in answer:
                with self.changed:
                    self.exits[answer["exited"]] = answer["code"]
                    self.changed.notify_all()
            else:  # refused, or gone: its children die with it (SIGKILL), none will be reported
                self.gone = answer.get("refused") or f"the zygote exited (code {self.proc.wait()})"
                if "refused" in answer:  # said once: every process is now a new interpreter, seconds slower each
                    # A warning, not a print: under `campaign launch`'s live table it goes to campaign.log.
                    warnings.warn(f"the zygote for {self.serves} cannot fork ({answer['refused']}): its processes are started "
                                  "on their own, each importing torch itself", ZygoteCannotFork, stacklevel=1)
                with self.changed:
                    for pid in self.children - set(self.exits):
                        self.exits[pid] = -signal.SIGKILL
                    self.changed.notify_all()
                self.started.put(self.gone)
                return

    def close(self, timeout: float = 30.0) -> None:
        """No more forks: the zygote kills and reaps the children still running, and exits."""
        try:
            self.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.socket.close()


if __name__ == "__main__":
    main()
