"""A trial's train.log, forwarded line by line to its Prefect task run (shown on the task
run's page), and not to the terminal: the live view and `campaign logs` show it there."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger
from prefect.logging.handlers import APILogHandler

POLL_S = 1.0
MAX_LINE = 4000  # characters: a runaway line (a dumped tensor) is cut, not sent whole

_to_api = logging.getLogger("campaign.trial_log")
_to_api.propagate = False  # the API only: Prefect's console handler sits on the root logger
_to_api.setLevel(logging.INFO)
if not any(isinstance(h, APILogHandler) for h in _to_api.handlers):
    _to_api.addHandler(APILogHandler())


class LogForwarder:
    """Sends what is appended to `path` from now on to the current task run's log."""

    def __init__(self, path: Path, start: int | None = None):
        """`start`: the offset of this segment's first line (it started before this), else the file's end now."""
        self.path = path
        # Earlier attempts' lines were sent then.
        self.position = start if start is not None else path.stat().st_size if path.exists() else 0
        try:
            self.logger = logging.LoggerAdapter(_to_api, get_run_logger().extra)
        except MissingContextError:  # called outside a task run (a test calling the function itself): nowhere to send
            self.logger = None
        self._partial = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"log {path.parent.name}", daemon=True)

    def __enter__(self) -> "LogForwarder":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.forward(final=True)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.forward()

    def forward(self, final: bool = False) -> None:
        if self.logger is None:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self.position)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.position += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = b"" if final else lines.pop()  # a line still being written waits for its end
        for line in lines:
            if line.strip():
                self.logger.info(line.decode(errors="replace")[:MAX_LINE])
