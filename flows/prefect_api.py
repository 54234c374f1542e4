"""Prefect's temporary API server, started while `campaign launch` checks the spec.

Without PREFECT_API_URL, Prefect starts a server of its own (a uvicorn process) the first
time a flow needs its API, and a launch waited for it after every check had run (4-10 s on
two cores). Started here on a thread instead, the process boots while the checks import
and size the trials; the flow then finds it running (Prefect keeps one per process). If it
fails to start, the flow's own start tries again and reports the error as it always has.
"""

from __future__ import annotations

import os
import threading


class TemporaryApi:
    """The server's start, on a thread; `ready()` waits for it (a no-op when none was needed)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        if os.environ.get("PREFECT_API_URL"):  # a server of the user's, the pool's or `campaign ui`'s
            return
        # A daemon thread: a launch refused for bad input exits at once, and Prefect's atexit
        # hook stops whatever was started.
        self.thread = threading.Thread(target=self._start, name="prefect-api-start", daemon=True)
        self.thread.start()

    @staticmethod
    def _start() -> None:
        from prefect.server.api.server import SubprocessASGIServer

        try:
            SubprocessASGIServer().start()
        except Exception:  # the flow's own start (the same server object) tries again, and says why
            pass

    def ready(self) -> None:
        if self.thread is not None:
            self.thread.join()
