"""A campaign's one metrics sink for the trials on its machine: a process that outlives a kill.

A trainer that finds `CAMPAIGN_METRICS_SOCKET` in its environment sends its metric lines
(the same JSON lines `training.metrics` pipes to a sink process) to this Unix socket
instead of starting a sink of its own. Why: a sink process imports MLflow (~2 s of CPU on
this kind of host) once per trainer or warm worker, and a warm worker's exit waited for
it; for short trials that import was still running when the last trial ended, so the
campaign returned seconds after its work was done. The hub imports MLflow once, while the
campaign's first trials start, and a trainer's end only closes its connection.

The campaign binds the socket before any trial starts and hands it to the hub process
(`python -m training.metrics_hub --listen-fd N`), so no trainer finds it missing while
the hub imports MLflow: lines wait in the hub's buffer meanwhile. The hub is a process, not
a thread of the campaign, for the same reason as the sink: a campaign killed outright
must not take its trials' last metrics with it. Its stdin is a pipe from the campaign;
when that closes (the campaign's end, or its death) the hub takes no new connection, reads
every open one to its end (the trials' processes have exited, or the warden ends them),
sends the rest and exits. The campaign waits for that before it reads MLflow.

A trainer that cannot reach a hub (no campaign on this machine: plain torchrun, a pool
node) starts its own sink, as before.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import warnings

from training.metrics import METRICS_SOCKET_ENV, _ignore_signals, _package_root, _Runs


class MetricsHub:
    """The campaign's side: the socket (in a private 0700 folder: only this user's
    processes connect), the hub process, and the wait for it at the end."""

    def __init__(self, flush_s: float = 2.0):
        self.folder = tempfile.mkdtemp(prefix="campaign-metrics-")  # short: a socket path has ~100 characters
        self.path = os.path.join(self.folder, "sink")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(self.path)
            server.listen(64)  # connections wait in the backlog until the hub takes them
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "training.metrics_hub", "--listen-fd", str(server.fileno()), "--path", self.path,
                 "--flush-s", str(flush_s)],
                stdin=subprocess.PIPE, pass_fds=(server.fileno(),), env={**os.environ, "PYTHONPATH": _package_root()})
        self.ended = False

    def env(self) -> dict[str, str]:
        """What a trial's processes need in their environment to log here."""
        return {METRICS_SOCKET_ENV: self.path}

    def end_input(self) -> None:
        """The trials' processes have exited: the hub reads every connection to its end,
        sends what is left, and exits (`close` waits for that)."""
        self.ended = True
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def close(self, timeout: float = 60.0) -> None:
        """End the input and wait until the hub has sent everything; warn if it could not in time."""
        self.end_input()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            warnings.warn(f"the metrics hub did not finish in {timeout:.0f} s; the trials' last metrics may be missing")
        shutil.rmtree(self.folder, ignore_errors=True)


_hub: MetricsHub | None = None


def open_metrics_hub() -> MetricsHub:
    """The hub the trials on this machine send their metrics through (one MLflow import,
    not one per trial), opened as the campaign's loop starts. Its path is in the environment
    the trials' processes inherit."""
    global _hub
    if _hub is not None and _hub.ended:  # an earlier campaign of this process that did not wait for its own
        close_metrics_hub()
    if _hub is None:
        _hub = MetricsHub()
        os.environ.update(_hub.env())
    return _hub


def end_metrics_hub() -> None:
    """The trials' processes have exited: no new trial logs here, and the hub starts sending
    the rest while the campaign writes its summary (`close_metrics_hub` waits for it)."""
    if _hub is not None:
        for key in _hub.env():
            os.environ.pop(key, None)
        _hub.end_input()


def close_metrics_hub() -> None:
    """Wait until the hub has sent every trial's metrics: before MLflow is read."""
    global _hub
    end_metrics_hub()
    hub, _hub = _hub, None
    if hub is not None:
        hub.close()


atexit.register(close_metrics_hub)  # a launch that fails before its flow ends its hub too (once, whatever the hubs)


class Hub:
    """The hub process: a reader thread per connection, one sender (a `log_batch` per run
    every `flush_s`, and at once for a run not seen before: its store is opened then).

    A trial resumed after a kill logs again the steps after its checkpoint; the sender keeps
    the first of each step it sees, so a killed trainer's lines must go out before its
    successor's. Each connection names its run in its first line, read as it is accepted
    (connections are accepted in the order trainers connected), and a connection's lines
    wait while an earlier connection to the same run is still being read."""

    HELLO_WAIT_S = 5.0  # a trainer sends its first line as it connects

    def __init__(self, server: socket.socket, path: str, flush_s: float, owned_folder: str | None = None):
        self.server, self.path, self.flush_s = server, path, flush_s
        self.owned_folder = owned_folder  # the socket's private folder, removed once no connection can come
        self.buffer: list[tuple[int, dict]] = []  # (connection's order of arrival, line)
        self.open_runs: dict[int, tuple] = {}  # connection's order -> the run it logs to, while it is read
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.closing = threading.Event()  # no new connections
        self.drained = threading.Event()  # every connection read to its end: send the rest and stop
        self.readers: list[threading.Thread] = []
        self.seen: set[tuple[str, str]] = set()
        self.acceptor = threading.Thread(target=self._accept, name="accept", daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed under us
                return
            self._start_reader(conn)
            if self.closing.is_set():  # woken by close(): take what else waits in the backlog, then stop
                self.server.setblocking(False)
                while True:
                    try:
                        conn, _ = self.server.accept()
                    except OSError:  # nothing more (BlockingIOError), or closed
                        return
                    self._start_reader(conn)

    def _start_reader(self, conn: socket.socket) -> None:
        conn.setblocking(True)  # an accepted socket may inherit the listener's non-blocking mode
        lines = conn.makefile("r", encoding="utf-8")
        run = None
        if select.select([conn], [], [], self.HELLO_WAIT_S)[0]:  # no wait on a connection that says nothing (close's wake-up)
            try:
                hello = json.loads(lines.readline() or "{}")
                run = (hello.get("uri"), hello.get("run")) if hello.get("opens") else None
            except (OSError, ValueError):
                pass
        with self.lock:
            order = len(self.readers)
            if run is not None:
                self.open_runs[order] = run
            reader = threading.Thread(target=self._read, args=(conn, lines, order), name="read", daemon=True)
            self.readers.append(reader)
        reader.start()

    def _read(self, conn: socket.socket, lines, order: int) -> None:
        with conn, lines:
            try:
                for line in lines:
                    item = json.loads(line)
                    if item.get("opens"):  # a first line not read at the accept (it came late)
                        continue
                    with self.lock:
                        self.buffer.append((order, item))
                        new_run = "run" in item and (item["uri"], item["run"]) not in self.seen
                        self.seen.add((item.get("uri"), item.get("run")))
                    if new_run:
                        self.wake.set()
            except (OSError, ValueError) as e:  # a trainer killed mid-line: what came whole is kept
                print(f"metrics hub: a connection ended badly ({e.__class__.__name__}: {e})", file=sys.stderr, flush=True)
            finally:
                with self.lock:
                    self.open_runs.pop(order, None)

    def _ready(self) -> list[dict]:
        """Take from the buffer what may go now: not a line whose run an earlier connection,
        still open, logs to too. Connections in the order they came, each in its own order."""
        with self.lock:
            ready, held = [], []
            for order, item in self.buffer:
                run = (item.get("uri"), item.get("run"))
                earlier_open = any(other < order and other_run == run for other, other_run in self.open_runs.items())
                (held if earlier_open else ready).append((order, item))
            self.buffer = held
        return [item for _, item in sorted(ready, key=lambda pair: pair[0])]

    def send_until_drained(self, runs: _Runs) -> None:
        while True:
            self.wake.wait(self.flush_s)
            self.wake.clear()
            done = self.drained.is_set()
            items = self._ready()
            if items:
                runs.send(items)
            if done:
                return

    def close(self) -> None:
        """No new connections; once every open one has ended, the sender sends the rest."""
        self.closing.set()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:  # the accept loop wakes and sees `closing`
            wake.connect(self.path)
        self.acceptor.join()
        self.server.close()
        if self.owned_folder:  # the hub outlives a campaign killed outright, whose own cleanup never ran
            shutil.rmtree(self.owned_folder, ignore_errors=True)
        with self.lock:
            readers = list(self.readers)
        for reader in readers:  # no time limit: a trainer still running keeps sending (as its own sink would take)
            reader.join()
        self.drained.set()
        self.wake.set()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A campaign's metrics hub: JSON lines from its trainers over a Unix socket, to MLflow.")
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--path", required=True)
    parser.add_argument("--flush-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    _ignore_signals()  # a signal to the campaign's process group is not for the hub: its stdin closing is
    hub = Hub(socket.socket(fileno=args.listen_fd), args.path, args.flush_s, owned_folder=os.path.dirname(args.path))  # accepting before MLflow is imported
    closer = threading.Thread(target=lambda: (sys.stdin.read(), hub.close()), name="stdin", daemon=True)
    closer.start()
    hub.send_until_drained(_Runs())
    # Everything is in MLflow (each log_batch committed): the campaign waits on this exit
    # before it reads the curves, and an interpreter's teardown with MLflow and SQLAlchemy
    # loaded took another 0.5 s.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
