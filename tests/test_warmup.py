"""Prefect's temporary server (flows/warmup.py): the flow run of a launch that started its own
server sends it no heartbeats (the server dies with the launch; Prefect joins its heartbeat
thread at the flow's end, in 1 s slices); against a server of the user's, heartbeats stay on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

FLOW = """
import json, os, sys
from flows.warmup import WarmUp
warm = WarmUp()  # starts a server only without PREFECT_API_URL
warm.ready()
from prefect import flow
from prefect.settings import get_current_settings

@flow
def probe():
    return get_current_settings().flows.heartbeat_frequency

with warm.flow_settings():
    inside = probe()
print(json.dumps({"started": warm.process is not None, "api": os.environ["PREFECT_API_URL"], "heartbeat": inside,
                  "after": get_current_settings().flows.heartbeat_frequency}))
"""


def run_probe(env: dict[str, str], tmp_path: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", FLOW], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**env, "PREFECT_HOME": str(tmp_path / "prefect-home")})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two temporary servers and two flows in their own processes
def test_no_flow_heartbeats_to_the_launchs_own_server_and_the_default_against_anothers(tmp_path):
    own = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    started = run_probe(own, tmp_path)
    assert started["started"] and started["heartbeat"] is None
    assert started["after"] is not None  # only the flow run's settings change, not the process's

    # A server of the user's (the harness of prefect's own tests would do too: any other URL).
    server = subprocess.Popen([sys.executable, "-c", "from flows.warmup import WarmUp; import sys, os; w = WarmUp(); w.ready(); "
                               "print(os.environ['PREFECT_API_URL'], flush=True); sys.stdin.read()"],
                              cwd=REPO, env={**own, "PREFECT_HOME": str(tmp_path / "server-home")},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        api = server.stdout.readline().strip()
        assert api.startswith("http://127.0.0.1:")
        theirs = run_probe({**own, "PREFECT_API_URL": api}, tmp_path)
        assert not theirs["started"] and theirs["api"] == api
        assert theirs["heartbeat"] is not None and theirs["heartbeat"] >= 30  # Prefect's default, left as the user set it
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def test_a_retryable_answer_of_the_temporary_server_says_to_retry_soon():
    """A 503 (SQLite refused a colliding write) gets `Retry-After`, which Prefect's client
    honours, in place of its own 2 s back-off; any other answer, or one that says already
    when to retry, is sent as it was."""
    import asyncio

    from prefect.client.base import _parse_retry_after

    from flows.warmup import RETRY_AFTER_S, RetrySoon

    async def headers_sent(status: int, headers: list) -> dict:
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": b""})

        sent = []

        async def send(message):
            sent.append(message)

        await RetrySoon(app)({"type": "http"}, None, send)
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        return dict(sent[0]["headers"])

    soon = asyncio.run(headers_sent(503, [(b"content-type", b"application/json")]))
    assert soon == {b"content-type": b"application/json", b"retry-after": RETRY_AFTER_S.encode()}
    assert _parse_retry_after(soon[b"retry-after"].decode()) == float(RETRY_AFTER_S) < 2
    assert asyncio.run(headers_sent(503, [(b"Retry-After", b"30")])) == {b"Retry-After": b"30"}
    assert asyncio.run(headers_sent(200, [])) == {}
