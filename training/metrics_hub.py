"""A campaign's one metrics sink for the trials on its machine: the trainers' side of its hub.

A trainer that finds `CAMPAIGN_METRICS_SOCKET` in its environment sends its metric lines
(the same JSON lines `training.metrics` pipes to a sink process) to this Unix socket
instead of starting a sink of its own. Why: a sink process imports MLflow (~2 s of CPU on
this kind of host) once per trainer or warm worker, and a warm worker's exit waited for
it; for short trials that import was still running when the last trial ended, so the
campaign returned seconds after its work was done. The hub imports MLflow once, while the
campaign's first trials start, and a trainer's end only closes its connection.

`Hub` reads the trainers' connections and sends their lines to MLflow. It runs in the
campaign's hub process (tasks/tracking_hub.py), which also makes the campaign's own MLflow
calls and pictures, and which outlives a campaign killed outright: its trials' last
metrics still reach MLflow.

A trainer that cannot reach a hub (no campaign on this machine: plain torchrun, a pool
node) starts its own sink, as before.
"""

from __future__ import annotations

import json
import select
import shutil
import socket
import sys
import threading

from training.metrics import _Runs


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
