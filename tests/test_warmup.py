"""Prefect's temporary server (flows/servers/warmup.py): the flow run of a launch that started its own
server sends it no heartbeats (the server dies with the launch); against a server of the user's,
which outlives it, the flow sends them itself (flows/run/heartbeat.py) and Prefect's engine, which
joins its heartbeat thread at the flow's end in 1 s slices, sends none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

FLOW = """
import json, os, sys, threading
from flows.servers.warmup import WarmUp
warm = WarmUp()  # starts a server only without PREFECT_API_URL
warm.ready()
from prefect import flow
from prefect.events.clients import AssertingEventsClient
from prefect.events.worker import EventsWorker
from prefect.runtime import flow_run
from prefect.settings import get_current_settings
from flows.run.heartbeat import heartbeats

events = EventsWorker.instance(AssertingEventsClient)  # what the flow emits, kept (as prefect.testing.fixtures does)
EventsWorker.instance = lambda *_: events

@flow
def probe():
    with heartbeats():  # as the campaign flow does
        return get_current_settings().flows.heartbeat_frequency, str(flow_run.id)

with warm.flow_settings():
    inside, run_id = probe()
events.drain()
beats = [e for client in AssertingEventsClient.all for e in client.events
         if e.event == "prefect.flow-run.heartbeat" and e.resource.id == f"prefect.flow-run.{run_id}"]
print(json.dumps({"started": warm.process is not None, "api": os.environ["PREFECT_API_URL"], "heartbeat": inside,
                  "after": get_current_settings().flows.heartbeat_frequency, "beats": len(beats),
                  "beating": any(t.name == "flow-run-heartbeat" for t in threading.enumerate())}))
"""


def run_probe(env: dict[str, str], tmp_path: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", FLOW], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**env, "PREFECT_HOME": str(tmp_path / "prefect-home")})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two temporary servers and two flows in their own processes
def test_no_flow_heartbeats_to_the_launchs_own_server_and_the_flows_own_against_anothers(tmp_path):
    own = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    started = run_probe(own, tmp_path)
    assert started["started"] and started["heartbeat"] is None and started["beats"] == 0
    assert started["after"] is not None  # only the flow run's settings change, not the process's

    # A server of the user's (the harness of prefect's own tests would do too: any other URL).
    server = subprocess.Popen([sys.executable, "-c", "from flows.servers.warmup import WarmUp; import sys, os; w = WarmUp(); w.ready(); "
                               "print(os.environ['PREFECT_API_URL'], flush=True); sys.stdin.read()"],
                              cwd=REPO, env={**own, "PREFECT_HOME": str(tmp_path / "server-home")},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        api = server.stdout.readline().strip()
        assert api.startswith("http://127.0.0.1:")
        theirs = run_probe({**own, "PREFECT_API_URL": api}, tmp_path)
        assert not theirs["started"] and theirs["api"] == api
        # Prefect's engine sends none; the flow sent its first at once, and its thread stopped with the flow.
        assert theirs["heartbeat"] is None and theirs["beats"] == 1 and not theirs["beating"]
        assert theirs["after"] is not None and theirs["after"] >= 30  # Prefect's default, left as the user set it
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def test_a_request_refused_as_retryable_is_run_again_within_the_server():
    """A 503 (SQLite refused a colliding write) is not sent: the request runs again, body and
    all, after 50 ms, 100 ms, ...; one refused for longer than the budget gets its 503, and
    Prefect's client its own back-off. Any other answer goes out as it is, the first time."""
    import asyncio

    from flows.servers.warmup import RetrySoon

    def serve(statuses: list[int], budget_s: float = 5.0):
        seen = []

        async def app(scope, receive, send):
            assert scope == {"type": "http", "path": "/api/x"}  # as the client sent it, each time
            scope["root_path"] = "/api"  # as Starlette's routing does
            seen.append((await receive())["body"])
            status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b"answer %d" % status})
            if status == 503:
                raise RuntimeError("database is locked")  # as Starlette raises again after its answer

        async def request():
            parts = [{"type": "http.request", "body": b"{\"a\": ", "more_body": True},
                     {"type": "http.request", "body": b"1}", "more_body": False}]
            sent = []

            async def send(message):
                sent.append(message)

            async def receive():
                return parts.pop(0)

            started = asyncio.get_running_loop().time()
            try:
                await RetrySoon(app, first_s=0.01, budget_s=budget_s)({"type": "http", "path": "/api/x"}, receive, send)
            except RuntimeError:
                pass
            return sent, seen, asyncio.get_running_loop().time() - started

        return asyncio.run(request())

    sent, seen, took = serve([503, 503, 200])
    assert [m.get("status") or m["body"] for m in sent] == [200, b"answer 200"]
    assert seen == [b'{"a": 1}'] * 3 and took >= 0.01 + 0.02
    sent, seen, took = serve([503], budget_s=0.05)  # 10 ms, 20 ms, then past the budget: the 503 goes out
    assert [m.get("status") or m["body"] for m in sent] == [503, b"answer 503"] and len(seen) == 3
    sent, seen, _ = serve([404])
    assert [m.get("status") or m["body"] for m in sent] == [404, b"answer 404"] and len(seen) == 1
