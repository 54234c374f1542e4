"""Prefect's temporary API server, started while `campaign launch` checks the spec.

Without PREFECT_API_URL, Prefect starts a server of its own (a uvicorn process) the first
time a flow needs its API, and a launch waited for it after every check had run (4-10 s on
two cores). Started here on a thread, the process boots while the checks import and size the
trials; the flow then finds it running (Prefect keeps one per process). If it fails to
start, the flow's own start tries again and reports the error as it always has.

Nothing else is made ahead: the checks must leave nothing behind when they refuse the spec,
so the MLflow store (a file) is created by the flow, after them.
"""

from __future__ import annotations

import logging
import os
import threading


class _HeldBack(logging.Filter):
    """Holds the records one thread logs to a logger: they are told once the launch has
    chosen where its logs go (the live view sends Prefect's lines to campaign.log)."""

    def __init__(self, thread: threading.Thread) -> None:
        super().__init__()
        self.thread, self.records = thread, []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread == self.thread.ident:
            self.records.append(record)
            return False
        return True


class WarmUp:
    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        if os.environ.get("PREFECT_API_URL"):  # a server of the user's, the pool's or `campaign ui`'s
            return
        # A daemon thread: a launch refused for bad input exits at once, and Prefect's atexit
        # hook stops whatever was started.
        self.thread = threading.Thread(target=self._start_api, name="prefect-api-start", daemon=True)
        self.held = _HeldBack(self.thread)
        logging.getLogger("prefect").addFilter(self.held)  # "Starting temporary server on ..."
        self.thread.start()

    @staticmethod
    def _start_api() -> None:
        from prefect.server.api.server import SubprocessASGIServer

        try:
            SubprocessASGIServer().start()
        except Exception:  # the flow's own start (the same server object) tries again, and says why
            pass

    def ready(self) -> None:
        """Wait for the server; what its start logged is told now, where logs go from here on."""
        if self.thread is None:
            return
        self.thread.join()
        logging.getLogger("prefect").removeFilter(self.held)
        for record in self.held.records:
            logging.getLogger(record.name).handle(record)
        self.held.records.clear()
