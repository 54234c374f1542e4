"""A node's host for an agent across nodes (training/elastic_host.py) starts only what the
agent signed: a request written into the agent's store by anyone else (unsigned, tampered
with, or copied under another key) starts nothing and is reported to the agent as refused.
The trial across nodes itself runs in tests/test_multinode.py (network namespaces)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from training.elastic_host import Host, host_key, request_problem, sign_request
from training.loopback import loopback_store


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("CAMPAIGN_CHECKPOINT_KEY", str(tmp_path / "checkpoint.key"))
    server = loopback_store(0, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def request(wid: str = "w1") -> dict:
    return {"wid": wid, "env": {}, "config": "/nonexistent/trial.json", "config_text": '{"model": {"target": "os:system"}}'}


def test_the_agents_signature_verifies_and_nothing_else_does(store):
    key = host_key("b", 1, "spawn", "0")
    signed = sign_request(key, request())
    assert request_problem(key, signed) is None
    assert request_problem(key, request()) == "unsigned"
    assert "does not verify" in request_problem(key, {**signed, "config_text": '{"model": {"target": "evil:run"}}'})
    assert "does not verify" in request_problem(host_key("b", 1, "spawn", "1"), signed)  # copied under another key
    assert "unexpected fields" in request_problem(key, {**signed, "cwd": "/"})


@pytest.mark.parametrize("how", ["unsigned", "tampered", "copied", "junk"])
def test_a_host_starts_nothing_it_was_not_sent_by_the_agent_and_says_so(store, how, capsys):
    host = Host(store, "b")
    key = host.key("spawn", "0")
    signed = sign_request(key, request())
    written = {"unsigned": json.dumps(request()), "tampered": json.dumps({**signed, "env": {"LD_PRELOAD": "/tmp/x.so"}}),
               "copied": json.dumps(sign_request(host.key("spawn", "7"), request())), "junk": "not json"}[how]
    store.set(key, written)
    host.step()
    assert host.workers == {} and host.next_spawn == 1  # nothing started, and the next request is the next key
    assert "refused" in capsys.readouterr().out
    if how != "junk":  # a request without a readable worker id has no exit to report
        assert store.get(host.key("exit", "w1")) == b"2"
        assert store.get(host.key("why", "w1")).decode().startswith("node b refused to start it")


def test_an_agent_keeps_rank_0_on_its_node_and_says_how_to_start_a_missing_host(tmp_path):
    """A command with no device on the agent's node is refused as a pool node's relay refuses
    (the trial goes on as it was); a device on a node with no host fails with the command that
    starts one."""
    from training.elastic import Agent, NodeBeats
    from training.agent_commands import AgentCommand, read_refusal

    control = tmp_path / "control"
    control.mkdir()
    agent = Agent(tmp_path / "trial.json", control, node="a")
    command = AgentCommand(seq=1, devices=({"id": "b/cpu0", "node": "b", "env": {}},))
    assert agent.apply(command) is None and agent.workers == {}
    refusal = read_refusal(control, 1)
    assert "no device on the agent's node 'a'" in refusal.reason and "b/cpu0" in refusal.reason
    with pytest.raises(TimeoutError, match=r"no host for node 'b'.*python -m training.elastic_host --store 127\.0\.0\.1:\d+ --node b"):
        NodeBeats(agent.store).host("b", agent.store_address(), timeout_s=0.2)
