"""Prefect's temporary API server, started the moment `campaign launch` begins; and Prefect's
server app as every server the project starts serves it (`server_app`, `serve`).

Without PREFECT_API_URL, Prefect starts a server of its own (a uvicorn process) the first
time a flow needs its API: the launch then waited for it after every check had run, and
before that it imported Prefect's whole server app in this process just to start one.
Here the same uvicorn command (as `prefect.server.api.server.SubprocessASGIServer` runs it)
is started before anything is imported, so it boots on another core while this process
imports and checks; this process then talks to it as to any server (PREFECT_API_URL) and
never loads the server app itself. The server ends with the launch: at its exit, or by the
kernel if the launch is killed outright.

Nothing else is made ahead: the checks must leave nothing behind when they refuse the spec,
so the MLflow store (a file) is made once they have passed (by the campaign's hub as it
starts, tasks/tracking_hub.py).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from flows.servers.prefect_template import CODE_ROOT, prepare_database, seed_block_memo
from training.process import die_with_parent, imports_without_gc

TEMPORARY_ENV = "CAMPAIGN_PREFECT_TEMPORARY"  # the API URL of the server started here (none recorded for it)
STARTUP_TIMEOUT_S = 60.0
PORT_IN_USE = 3  # uvicorn's exit code when it cannot bind


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_app():
    """Prefect's server app, as `prefect server start` serves it, retrying within the server
    what its database refused as retryable (RetrySoon)."""
    prepare_database()  # before Prefect reads its settings
    with imports_without_gc():  # the server's modules, kept for its life (~0.55 s of its boot's 2.9 s of CPU)
        from prefect.server.api.server import create_app

    seed_block_memo()  # before the app's start writes the block types
    return RetrySoon(create_app())


def serve(host: str, port: int) -> None:
    """Prefect's server as `prefect server start` runs it in the foreground (one process: its
    API, services and UI, settings from the environment), with server_app's retries:
    `campaign ui` and `campaign pool server` run it (`python -m flows.servers.warmup --host H --port P`),
    where a pool's segments start together on several nodes."""
    prepare_database()  # before Prefect reads its settings
    with imports_without_gc():  # as server_app's
        import uvicorn
        from prefect.server.api.server import create_app
        from prefect.settings import get_current_settings

    seed_block_memo()  # before the app's start writes the block types
    settings = get_current_settings().server
    uvicorn.run(RetrySoon(create_app(final=True)), host=host, port=port, timeout_keep_alive=settings.api.keepalive_timeout,
                ws_ping_interval=settings.api.websocket_ping_interval, ws_ping_timeout=settings.api.websocket_ping_timeout,
                log_level=str(settings.logging_level).lower())


def import_flow_start() -> None:
    """What a flow run's start imports in the launch's process: Prefect's flow and task engines
    (~0.3 s on their own, graphviz included) and FastAPI, whose encoder Prefect imports to
    store the flow's parameters (~80 ms after the rest, the flow's first moment: found in a
    sampling profile of a cold launch). The resident server's spare launch imports them too
    (tasks/spares.py)."""
    import fastapi.encoders  # noqa: F401
    import prefect.flow_engine  # noqa: F401
    import prefect.task_engine  # noqa: F401


class RetrySoon:
    """ASGI middleware: a request the app answers with 503 is run again within the server,
    after 50 ms, then 100, 200, ... while under `budget_s` in all; then its 503 goes out.

    Prefect's SQLite database refuses a write that collides with another (SQLITE_BUSY on a
    read transaction turned write: the busy timeout does not wait there) and the server
    answers 503, which Prefect's client retries after 2 s, 4, 8 ... Two task runs starting
    together collide this way on the slots of their tags (`bulk_increment_active_slots`): an
    8-trial campaign on two slots lost 2 s of a slot in every launch tried. The collision is
    over within milliseconds. A constant `Retry-After` of 50 ms would do for that, but the
    client tries only five more times, so a busier database (a pool's server, a loaded host)
    could make it give up within ~0.3 s; here the waits double, and the client's own back-off
    still follows a 503 that lasts. The request is run again exactly as the client would send
    it again: a refused transaction was rolled back."""

    def __init__(self, app, first_s: float = 0.05, budget_s: float = 5.0) -> None:
        self.app, self.first_s, self.budget_s = app, first_s, budget_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        parts = []
        while True:  # the whole request, to give it again
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body, delay, waited = b"".join(parts), self.first_s, 0.0
        while await self._refused(scope, body, send, last=waited + delay > self.budget_s):
            await asyncio.sleep(delay)
            waited, delay = waited + delay, delay * 2

    async def _refused(self, scope, body: bytes, send, last: bool) -> bool:
        """Run the request once; True if it was answered 503 and that answer held back."""
        given, refused = False, False

        async def replay():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # as a server does after the body: until the client leaves (never, here)

        async def hold_back_503(message) -> None:
            nonlocal refused
            if message["type"] == "http.response.start" and message["status"] == 503 and not last:
                refused = True
            if not refused:
                await send(message)

        try:  # each run gets its own copy of the scope: Starlette's routing writes into it (a mount's root path)
            await self.app(dict(scope), replay, hold_back_503)
        except Exception:  # Starlette raises again after it answered the 503
            if not refused:
                raise
        return refused


class WarmUp:
    def __init__(self, server_env: dict[str, str] | None = None) -> None:
        """`server_env`: settings for the server process alone (the tests give each of their
        processes a server with its own database)."""
        self.process: subprocess.Popen | None = None
        self.server_env = server_env or {}
        if os.environ.get("PREFECT_API_URL"):  # a server of the user's, the pool's or `campaign ui`'s
            return
        self._start()
        # Before Prefect is imported here: its settings read the environment once.
        os.environ["PREFECT_API_URL"] = os.environ[TEMPORARY_ENV] = self.api_url
        atexit.register(self.stop)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _start(self) -> None:
        self.port = free_port()
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
               **self.server_env}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(CODE_ROOT), "--factory", "flows.servers.warmup:server_app",
             "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
            env=env, preexec_fn=lambda: die_with_parent(signal.SIGTERM))

    def flow_settings(self):
        """Prefect's settings for the campaign's flow run: against the server started here, no
        flow-run heartbeats. They exist so that a server that outlives a crashed run can mark it
        crashed; this server dies with the launch. Against a server of the user's, which
        outlives it, the flow sends them itself (flows/run/heartbeat.py)."""
        if self.process is None:
            from flows.run.heartbeat import engine_heartbeats_off

            return engine_heartbeats_off()
        from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

        return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})

    def ready(self) -> None:
        """Wait until the server answers. What the flow's start would import is imported
        first (`import_flow_start`): while the server boots, this process has nothing else to do."""
        import_flow_start()
        self._wait_for_server()

    def _wait_for_server(self) -> None:
        if self.process is None:
            return
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code == PORT_IN_USE:  # another process took the port since it was chosen
                self._start()
                os.environ["PREFECT_API_URL"] = os.environ[TEMPORARY_ENV] = self.api_url
                continue
            if code is not None:
                raise RuntimeError(f"Prefect's temporary server exited with code {code} before it answered")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"Prefect's temporary server did not answer within {STARTUP_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self.process is None:
            return
        # Waited for, as Prefect waits for its own: it closes its database in PREFECT_HOME.
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Prefect's server as `prefect server start` runs it, refused writes retried within it")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4200)
    args = parser.parse_args()
    serve(args.host, args.port)
