"""A campaign's one metrics sink, inside the campaign process, for the trials on its machine.

A trainer that finds `CAMPAIGN_METRICS_SOCKET` in its environment sends its metric lines
(the same JSON lines `training.metrics` pipes to a sink process) to this Unix socket
instead of starting a sink of its own. Why: a sink process imports MLflow (~2 s of CPU on
this kind of host) once per trainer or warm worker, and a warm worker's exit waited for
it; for short trials that import was still running when the last trial ended, so the
campaign returned seconds after its work was done. The campaign process has MLflow
imported and its store open already, so here a trial's metrics cost one socket write per
log step and a `log_batch` every `flush_s` on a thread.

A trainer's close only closes its connection; the campaign closes the hub after its
trials' processes have exited (`close`): every connection read to its end, the rest sent,
before the campaign reads MLflow for its summary and pictures. A trainer that cannot reach
the hub (no campaign on this machine: plain torchrun, a pool node) starts its own sink as before.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

from training.metrics import METRICS_SOCKET_ENV, _Runs


class MetricsHub:
    """Listens on a Unix socket in a private folder (0700: only this user's processes
    connect) and sends what arrives to MLflow from one thread."""

    def __init__(self, flush_s: float = 2.0):
        self.flush_s = flush_s
        self.folder = tempfile.mkdtemp(prefix="campaign-metrics-")  # short: a socket path has ~100 characters
        self.path = os.path.join(self.folder, "sink")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(64)
        self._buffer: list[dict] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()  # no new connections
        self._drained = threading.Event()  # every connection read to its end: send the rest and stop
        self._readers: list[threading.Thread] = []
        self._runs = _Runs()
        self._seen: set[tuple[str, str]] = set()
        self._acceptor = threading.Thread(target=self._accept, name="metrics-hub-accept", daemon=True)
        self._sender = threading.Thread(target=self._send, name="metrics-hub-send", daemon=True)
        self._acceptor.start()
        self._sender.start()

    def env(self) -> dict[str, str]:
        """What a trial's processes need in their environment to log here."""
        return {METRICS_SOCKET_ENV: self.path}

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed under us
                return
            self._start_reader(conn)
            if self._closing.is_set():  # woken by close(): take what else waits in the backlog, then stop
                self._server.setblocking(False)
                while True:
                    try:
                        conn, _ = self._server.accept()
                    except OSError:  # nothing more (BlockingIOError), or closed
                        return
                    self._start_reader(conn)

    def _start_reader(self, conn: socket.socket) -> None:
        conn.setblocking(True)  # an accepted socket may inherit the listener's non-blocking mode
        reader = threading.Thread(target=self._read, args=(conn,), name="metrics-hub-read", daemon=True)
        with self._lock:
            self._readers.append(reader)
        reader.start()

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("r", encoding="utf-8") as lines:
            try:
                for line in lines:
                    item = json.loads(line)
                    with self._lock:
                        self._buffer.append(item)
                        new_run = "run" in item and (item["uri"], item["run"]) not in self._seen
                        self._seen.add((item.get("uri"), item.get("run")))
                    if new_run:  # its store and logged steps are read now, while the trial trains, not at its end
                        self._wake.set()
            except (OSError, ValueError) as e:  # a trainer killed mid-line: what came whole is kept
                print(f"metrics hub: a connection ended badly ({e.__class__.__name__}: {e})", file=sys.stderr, flush=True)

    def _send(self) -> None:
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            done = self._drained.is_set()
            with self._lock:
                items, self._buffer = self._buffer, []
            if items:
                self._runs.send(items)
            if done:
                return

    def close(self, timeout: float = 30.0) -> None:
        """After the trials' processes have exited: read every connection to its end, send
        what is left, and stop. A connection still open after `timeout` (a process that
        outlived its trial) is left; what it sent until then is sent."""
        self._closing.set()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:  # the accept loop wakes and sees `_closing`
            wake.connect(self.path)
        self._acceptor.join()
        self._server.close()
        deadline = time.monotonic() + timeout
        with self._lock:
            readers = list(self._readers)
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        self._drained.set()
        self._wake.set()
        self._sender.join(max(1.0, deadline - time.monotonic()))
        shutil.rmtree(self.folder, ignore_errors=True)
