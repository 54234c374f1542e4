"""The campaign's hub: one process that makes every MLflow call of the campaign, and draws its pictures.

It does two jobs that both need MLflow imported (~2 s of CPU with its SQLite store, on this
kind of host), so that `campaign launch` itself imports neither MLflow nor matplotlib:
- the trainers' metrics: the trials on this machine send their metric lines to its Unix
  socket (training/metrics_hub.py's `Hub`), and it sends them to MLflow in batches;
- the campaign's own calls: the functions marked `@in_hub` (tasks/hub_calls.py: opening and
  closing runs, system metrics, the pictures) run here when `launch` calls them, one at a
  time, in the order they came, each answered before the next.

The campaign binds the socket before any trial starts and hands it over (`python -m
tasks.tracking_hub --listen-fd N`), so no trainer finds it missing while the hub imports
MLflow: lines wait in the hub's buffer meanwhile. Calls come as JSON lines on the hub's
stdin; answers go back on a pipe of their own (`--answer-fd`: nothing a library prints can
mix with them); a call sent `unanswered` (tasks.hub_calls.in_hub_unanswered) is answered only
if it fails, and the campaign reads that answer when it next can. Two calls steer the
metrics: `end_input` (every trial's process has exited: take no new connection, read every
open one to its end and send the rest, while the campaign writes its summary) and `drain`
(wait for that: the curves read MLflow after it).

The hub is a process, not a thread of the campaign, for the same reason as a sink: a
campaign killed outright must not take its trials' last metrics with it. When its stdin
closes (the campaign's end, or its death) it ends its input as above, sends the rest and
exits; the campaign waits for that exit.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

from tasks.hub_calls import HubCallError, HubGone, registered, use_hub
from training.metrics import METRICS_SOCKET_ENV, _ignore_signals, _package_root, _Runs
from training.files import private_temp_dir
from training.metrics_hub import Hub
from training.process import imports_without_gc

log = logging.getLogger(__name__)

# The modules whose `@in_hub` functions the hub serves (imported there, by name, at its start).
SERVED = ("tasks.tracking", "tasks.curves", "tasks.timeline", "tasks.system_metrics")
END_INPUT, DRAIN = "end_input", "drain"  # the hub's own calls


class MetricsHub:
    """The campaign's side: the socket (in a private 0700 folder: only this user's
    processes connect), the hub process, its calls, and the wait for it at the end."""

    def __init__(self, flush_s: float = 2.0, store: str | None = None):
        """`store`: the MLflow tracking URI whose store the hub builds as it starts."""
        self.folder = str(private_temp_dir("campaign-metrics-"))  # short: a socket path has ~100 characters
        self.path = os.path.join(self.folder, "sink")
        answers, answer_fd = os.pipe()
        args = ["--path", self.path, "--flush-s", str(flush_s), *(["--store", store] if store else [])]
        env = {**os.environ, "PYTHONPATH": _package_root()}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(self.path)
            server.listen(64)  # connections wait in the backlog until the hub takes them
            try:
                self.proc = self._spare(server.fileno(), answer_fd, args, env) or subprocess.Popen(
                    [sys.executable, "-m", "tasks.tracking_hub", "--listen-fd", str(server.fileno()), "--answer-fd", str(answer_fd),
                     *args], stdin=subprocess.PIPE, pass_fds=(server.fileno(), answer_fd), env=env, text=True)
            finally:
                os.close(answer_fd)
        self.answers = answers  # the read end of the hub's answer pipe (a file descriptor)
        self._pending = b""  # what came of the next answer so far
        self.ended = False
        self.gone = False
        # Calls come from several threads (the flow's loop, the system sampler, the run opener):
        # `_lock` guards sending and the bookkeeping, `_reading` the answer pipe (one reader).
        self._lock = threading.Lock()
        self._reading = threading.Lock()
        self._next = 0
        self._waiting: set[int] = set()  # calls whose callers wait for their answers
        self._answered: dict[int, dict] = {}  # answers read by another caller's thread, for their own
        self._unanswered: dict[int, str] = {}  # calls sent with no caller waiting: id -> name

    @staticmethod
    def _spare(listen_fd: int, answer_fd: int, args: list[str], env: dict[str, str]):
        """The folder's resident server's spare hub, MLflow imported already, as this hub
        (tasks/spares.py), given what the hub would be started with; None if none is taken."""
        from tasks.spares import Adopted, claim

        stdin_read, stdin_write = os.pipe()
        try:
            pid = claim("hub", [listen_fd, answer_fd, stdin_read, 1, 2],  # its output where a started hub's goes
                        {"args": args, "hub_env": env})
        finally:
            os.close(stdin_read)
        if pid is None:
            os.close(stdin_write)
            return None
        return Adopted(pid, stdin=os.fdopen(stdin_write, "w", encoding="utf-8"))

    def env(self) -> dict[str, str]:
        """What a trial's processes need in their environment to log here."""
        return {METRICS_SOCKET_ENV: self.path}

    def call(self, name: str, args: list, kwargs: dict, timeout: float | None = None) -> Any:
        """Run `name` (an `@in_hub` function, or END_INPUT / DRAIN) in the hub and return its
        result; HubGone if the hub cannot answer (the caller then runs it itself), or has not
        within `timeout` seconds (it is then ended: what it held is lost, and said so).
        Threads may call at once: each waits for its own answer only (the hub runs the calls
        in the order they came)."""
        ident = self._send(name, args, kwargs)
        try:
            answer = self._await(ident, name, timeout)
        finally:
            with self._lock:
                self._waiting.discard(ident)
                self._answered.pop(ident, None)
        if "error" in answer:
            raise HubCallError(f"{name} failed in the campaign's hub: {answer['error']}")
        return answer.get("value")

    def call_unanswered(self, name: str, args: list, kwargs: dict | None = None) -> None:
        """Send `name` to run in the hub and return at once: its answer comes only if it
        fails, and is read (its error logged) when the hub's answers are next read. HubGone
        if the hub cannot take it (the caller then runs it itself)."""
        self._send(name, args, kwargs or {}, unanswered=True)
        self._read_ready()

    def _send(self, name: str, args: list, kwargs: dict, unanswered: bool = False) -> int:
        with self._lock:
            if self.gone:
                raise HubGone(name)
            self._next += 1
            request = {"id": self._next, "name": name, "args": args, "kwargs": kwargs, **({"unanswered": True} if unanswered else {})}
            try:
                self.proc.stdin.write(json.dumps(request, default=str) + "\n")
                self.proc.stdin.flush()
            except (OSError, ValueError):  # a broken or closed pipe
                self.gone = True
                raise HubGone(name) from None
            if unanswered:
                self._unanswered[self._next] = name
            else:
                self._waiting.add(self._next)
            return self._next

    def _await(self, ident: int, name: str, timeout: float | None) -> dict:
        """Call `ident`'s answer: read from the pipe by one waiting thread at a time, which
        hands the others theirs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._reading:
                with self._lock:
                    if ident in self._answered:
                        return self._answered.pop(ident)
                    if self.gone:
                        raise HubGone(name)
                try:
                    line = self._answer(deadline)
                except (OSError, ValueError):
                    line = b""
                if line is None:
                    self.proc.kill()
                    warnings.warn(f"the metrics hub did not answer {name} in {timeout:.0f} s; the trials' last metrics may be missing")
                if not line:
                    self.gone = True
                    raise HubGone(name)
                answer = json.loads(line)
                if answer["id"] == ident:
                    return answer
                self._deliver(answer)
            time.sleep(0)  # a thread whose answer this one read takes the reading lock first

    def _deliver(self, answer: dict) -> None:
        """An answer read by a thread it is not for: a waiting thread's, or one no one waits
        for (an unanswered call's error, logged; an interrupted call's)."""
        with self._lock:
            if answer["id"] in self._waiting:
                self._answered[answer["id"]] = answer
                return
            name = self._unanswered.pop(answer["id"], None)
        if name is not None and "error" in answer:
            log.warning("%s failed in the campaign's hub: %s", name, answer["error"])

    def _read_ready(self) -> None:
        """The answers in the pipe now, read without waiting (unless a thread is reading):
        calls that no one waits for never fill it."""
        if not self._reading.acquire(blocking=False):
            return  # that thread reads them
        try:
            while select.select([self.answers], [], [], 0)[0] and (chunk := os.read(self.answers, 1 << 16)):
                self._pending += chunk
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                self._deliver(json.loads(line))
        except (OSError, ValueError):
            pass  # a closed pipe: the next call finds the hub gone
        finally:
            self._reading.release()

    def _answer(self, deadline: float | None) -> bytes | None:
        """The hub's next answer line; b"" if its pipe closed, None if none came by `deadline`."""
        while b"\n" not in self._pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([self.answers], [], [], left)[0]):
                return None
            chunk = os.read(self.answers, 1 << 16)
            if not chunk:
                return b""
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def end_input(self) -> None:
        """The trials' processes have exited: the hub reads every connection to its end and
        sends what is left, while its caller goes on (`drain` waits for it)."""
        if not self.ended:
            self.ended = True
            try:
                self.call(END_INPUT, [], {})
            except HubGone:
                pass

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until the hub has sent every trial's metrics to MLflow (a trainer still
        connected after `timeout` seconds: the hub is ended, and that said)."""
        self.end_input()
        try:
            self.call(DRAIN, [], {}, timeout=timeout)
        except HubGone:
            pass

    def close(self, timeout: float = 60.0) -> None:
        """End the input, close the hub's stdin and wait until it has sent everything and
        exited; warn if it could not in time."""
        self.end_input()
        with self._lock:
            self.gone = True
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            warnings.warn(f"the metrics hub did not finish in {timeout:.0f} s; the trials' last metrics may be missing")
        if self.answers >= 0:
            os.close(self.answers)
            self.answers = -1
        shutil.rmtree(self.folder, ignore_errors=True)


_hub: MetricsHub | None = None


def open_metrics_hub(store: str | None = None) -> MetricsHub:
    """The hub of this process's campaign: the trials on this machine send their metrics
    through it (its path is in the environment their processes inherit), and this process's
    `@in_hub` calls run in it. Opened before the campaign's first MLflow call (`store`: the
    tracking URI whose store it builds meanwhile)."""
    global _hub
    if _hub is not None and _hub.ended:  # an earlier campaign of this process that did not wait for its own
        close_metrics_hub()
    if _hub is None:
        _hub = MetricsHub(store=store)
        os.environ.update(_hub.env())
        use_hub(_hub)
    return _hub


def build_store_ahead(uri: str) -> None:
    """The hub builds `uri`'s MLflow store now (~1.5 s for a new SQLite one), while this process
    goes on: once the checks have passed (nothing is written before), the flow's first MLflow
    call finds it built."""
    if _hub is not None:
        try:
            _hub.call_unanswered("tasks.tracking.build_store", [uri])
        except HubGone:
            pass  # the first call builds it


def end_metrics_hub() -> None:
    """The trials' processes have exited: no new trial logs here, and the hub starts sending
    the rest while the campaign writes its summary (`drain_metrics_hub` waits for it)."""
    if _hub is not None:
        for key in _hub.env():
            os.environ.pop(key, None)
        _hub.end_input()


def drain_metrics_hub() -> None:
    """Wait until the hub has sent every trial's metrics: before MLflow is read."""
    if _hub is not None:
        end_metrics_hub()
        _hub.drain()


def close_metrics_hub() -> None:
    """The campaign is done with its hub: it sends what is left and exits; calls run here again."""
    global _hub
    end_metrics_hub()
    hub, _hub = _hub, None
    if hub is not None:
        use_hub(None)
        hub.close()


atexit.register(close_metrics_hub)  # a launch that fails before its flow ends its hub too (once, whatever the hubs)


# --- the hub process ---------------------------------------------------------------------
def serve_calls(hub: Hub, sender: threading.Thread, answers, store: str | None = None) -> None:
    """Run the campaign's calls as they come on stdin, until it closes (`store` built first:
    the first call waits for it anyway)."""
    with imports_without_gc():  # MLflow, matplotlib and the store's engine: kept for the hub's life
        for module in SERVED:
            importlib.import_module(module)
        if store:
            from tasks.tracking import open_store

            open_store(store)
        from tasks.timeline import import_matplotlib

        # The pictures' matplotlib too, before the first call, as the resident server's spare
        # hub has it (tasks/spares.py): imported while trials ran (~0.4 s of CPU), it held the
        # calls that start a short trial's successor back 0.1-0.35 s each, and a campaign of
        # short trials, cold, had gaps of 0.06-0.09 s between them instead of 0.03.
        import_matplotlib()
    ending: threading.Thread | None = None

    def end_input() -> threading.Thread:
        thread = threading.Thread(target=hub.close, name="end-input", daemon=True)
        thread.start()
        return thread

    for line in sys.stdin:
        request = json.loads(line)
        name = request["name"]
        try:
            if name == END_INPUT:
                ending = ending or end_input()
                value = None
            elif name == DRAIN:
                ending = ending or end_input()
                ending.join()
                sender.join()
                value = None
            else:
                value = registered(name)(*request["args"], **request["kwargs"])
            answer = {"id": request["id"], "value": value}
        except Exception as e:  # the caller raises it (or logs it, for an unanswered call); the hub goes on
            answer = {"id": request["id"], "error": f"{e.__class__.__name__}: {e}"}
        if request.get("unanswered") and "error" not in answer:
            continue  # no one waits for it: only its error is said
        answers.write(json.dumps(answer, default=str) + "\n")
        answers.flush()
    if ending is None:  # the campaign ended or died without ending the input
        end_input()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A campaign's hub: its trainers' metrics and its own MLflow calls.")
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--path", required=True)
    parser.add_argument("--flush-s", type=float, default=2.0)
    parser.add_argument("--answer-fd", type=int, required=True)
    parser.add_argument("--store", help="the MLflow tracking URI whose store to build at once")
    args = parser.parse_args(argv)
    _ignore_signals()  # a signal to the campaign's process group is not for the hub: its stdin closing is
    hub = Hub(socket.socket(fileno=args.listen_fd), args.path, args.flush_s, owned_folder=os.path.dirname(args.path))  # accepting before MLflow is imported
    sender = threading.Thread(target=lambda: hub.send_until_drained(_Runs()), name="sender")
    sender.start()
    with os.fdopen(args.answer_fd, "w", encoding="utf-8") as answers:
        try:
            serve_calls(hub, sender, answers, args.store)
        except (BrokenPipeError, OSError):  # the campaign died mid-answer: its metrics still go out
            if not hub.closing.is_set():
                threading.Thread(target=hub.close, daemon=True).start()
        sender.join()
    # Everything is in MLflow (each log_batch committed): the campaign waits on this exit,
    # and an interpreter's teardown with MLflow and SQLAlchemy loaded took another 0.5 s.
    from tasks.tracking import fold_logs

    fold_logs()  # (os._exit runs no atexit hook)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
