"""A signed pool segment runs once (flows/pool/secret.py `signed_segment`, `accept_segment`):
the node's segment flow, called as a worker's flow run calls it, runs a signed segment once
and refuses the same parameters and signature again, an expired one, an unbound one, and
one whose attempt id was changed, all before it leases anything; of flow runs racing with
one attempt id exactly one is accepted."""

from __future__ import annotations

import json
import sqlite3
import sys
import threading
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from flows.pool.secret import (CLOCK_SKEW_S, PRUNE_AFTER_S, SECRET_ENV, VALIDITY_ENV, PoolSecretError, accept_segment,
                               attempts_path, init_secret, load_secret, record_attempt, sign, signed_segment)
from training.config import TrialConfig
from training.layout import trial_files

CPU = {"id": "a/cpu0", "node": "a", "index": 0, "kind": "cpu", "name": "CPU core 0", "memory_bytes": 1 << 30}


@pytest.fixture
def node(tmp_path, monkeypatch):
    """This process as pool `lab`'s node `a` (what `campaign worker` sets for its flow runs),
    its lease database in the test's folder."""
    monkeypatch.chdir(tmp_path)
    path = init_secret("lab", tmp_path)
    monkeypatch.setenv(SECRET_ENV, str(path))
    monkeypatch.setenv("CAMPAIGN_POOL", "lab")
    monkeypatch.setenv("CAMPAIGN_NODE", "a")
    monkeypatch.setenv("CAMPAIGN_LEASE_DB", str(tmp_path / "node-a" / "leases.db"))
    monkeypatch.delenv(VALIDITY_ENV, raising=False)
    return tmp_path


@pytest.fixture
def launches(node, monkeypatch):
    """What the node's segments lease and start: each lease it takes (holders, in order) and a
    line in `launches.txt` per trial process started. The trial process is a stand-in for the
    trainer (a real process, started by the real launch, that writes a result at once)."""
    import flows.pool.segment as segment
    from cluster.leases import LeaseStore

    taken: list[str] = []
    started = node / "launches.txt"

    class WatchedLeaseStore(LeaseStore):
        def acquire(self, holder, *args, **kwargs):
            taken.append(holder)
            return super().acquire(holder, *args, **kwargs)

    def stand_in_launch(cfg, placed, cwd, **kwargs):
        plan = plan_launch(cfg, placed, cwd, **kwargs)
        result = {"trial_id": cfg.trial_id, "steps": 1, "checkpoint": "step-00000001", "metrics": {"loss": 0.0}}
        script = (f"from training.result import write_result; open({str(started)!r}, 'a').write('launched\\n'); "
                  f"write_result({str(trial_files(cfg.trial_dir).result)!r}, {result!r})")  # signed, as a trainer's
        return replace(plan, command=[sys.executable, "-c", script])

    plan_launch = segment.plan_launch
    monkeypatch.setattr(segment, "LeaseStore", WatchedLeaseStore)
    monkeypatch.setattr(segment, "plan_launch", stand_in_launch)
    return taken, started


def segment_params(folder: Path) -> dict:
    config = TrialConfig(trial_id="t", seed=0, model={"name": "mlp"}, data={}, steps=1, batch_size=1, lr=0.1,
                         trial_dir=str(folder / "t"))
    return {"config": asdict(config), "devices": [CPU], "cwd": str(folder), "campaign": "c", "span": None, "elastic": False,
            "node_devices": [CPU]}


def run_segment(sent: dict):
    """The node's segment flow with `sent` as its parameters, as its worker's flow run calls it
    (through JSON, as Prefect hands them over)."""
    from flows.pool.segment import trial_segment

    return trial_segment.fn(**json.loads(json.dumps(sent)))


def launched(started: Path) -> int:
    return len(started.read_text().splitlines()) if started.exists() else 0


def attempts_of_record(folder: Path) -> int:
    return json.loads(trial_files(folder / "t").record.read_text())["attempts"]


def test_a_signed_segment_runs_once_and_its_replay_is_refused_before_anything_is_leased(node, launches):
    from cluster.leases import LeaseStore

    taken, started = launches
    sent = signed_segment(load_secret("lab", node), segment_params(node))
    assert run_segment(sent)["metrics"] == {"loss": 0.0}
    assert len(taken) == 1 and launched(started) == 1 and attempts_of_record(node) == 1
    record_before = trial_files(node / "t").record.read_bytes()

    with pytest.raises(PoolSecretError, match=rf"attempt {sent['attempt_id']} of trial t was already run on node a at "
                                              r"\S+: a replay is refused"):
        run_segment(sent)  # the same parameters and signature again
    assert len(taken) == 1 and launched(started) == 1  # nothing leased, no trial process started
    assert trial_files(node / "t").record.read_bytes() == record_before and LeaseStore().leases() == []
    assert attempts_path() == node / "node-a" / "leases.db.segments" and attempts_path().exists()

    # The campaign sending the trial again signs a new attempt: that one runs.
    run_segment(signed_segment(load_secret("lab", node), segment_params(node)))
    assert len(taken) == 2 and launched(started) == 2 and attempts_of_record(node) == 2


def test_an_expired_segment_is_refused_before_anything_is_leased(node, launches):
    taken, started = launches
    signed_two_hours_ago = signed_segment(load_secret("lab", node), segment_params(node), now=time.time() - 2 * 3600)
    with pytest.raises(PoolSecretError, match=rf"attempt {signed_two_hours_ago['attempt_id']} of trial t expired at "):
        run_segment(signed_two_hours_ago)
    assert taken == [] and launched(started) == 0 and not (node / "t").exists()


def test_a_segment_changed_or_unbound_after_signing_is_refused_and_burns_no_attempt(node, launches):
    taken, started = launches
    secret = load_secret("lab", node)
    sent = signed_segment(secret, segment_params(node))
    for changed in ({"attempt_id": uuid.uuid4().hex}, {"expires_at": sent["expires_at"] + 86400}):
        with pytest.raises(PoolSecretError, match="does not verify"):
            run_segment({**sent, **changed})
    with pytest.raises(PoolSecretError, match="does not verify"):  # a forgery reusing the genuine attempt id
        run_segment({**sent, "signature": "0" * 64})
    unbound = segment_params(node)  # as a campaign older than replay protection signs it
    with pytest.raises(PoolSecretError, match="signed without an attempt id and expiry"):
        run_segment({**unbound, "signature": sign(secret, unbound)})
    assert taken == [] and launched(started) == 0 and not attempts_path().exists()
    run_segment(sent)  # none of the refused used up the genuine segment's attempt
    assert len(taken) == 1 and launched(started) == 1


def test_expiry_allows_clock_skew_only_in_the_past_and_the_validity_is_set_by_the_environment(node, monkeypatch):
    secret = load_secret("lab", node)
    monkeypatch.setenv(VALIDITY_ENV, "90")
    signed_at = time.time()
    sent = signed_segment(secret, segment_params(node), now=signed_at)
    assert sent["expires_at"] == signed_at + 90
    payload = {k: v for k, v in sent.items() if k != "signature"}
    with pytest.raises(PoolSecretError, match="expired at"):  # the node's clock past expiry and the skew allowed
        accept_segment(secret, payload, sent["signature"], "a", now=sent["expires_at"] + CLOCK_SKEW_S + 1)
    accept_segment(secret, payload, sent["signature"], "a", now=sent["expires_at"] + CLOCK_SKEW_S - 1)  # within the skew
    for bad in ("0", "-5", "soon", "nan"):
        monkeypatch.setenv(VALIDITY_ENV, bad)
        with pytest.raises(PoolSecretError, match=VALIDITY_ENV):
            signed_segment(secret, segment_params(node))


def test_of_flow_runs_racing_with_one_attempt_exactly_one_is_accepted(node):
    """Eight threads, each with its own connection as each flow run has, released together
    on a fresh file: one records the attempt, seven are told it was already run."""
    path = attempts_path()
    attempt, racers = uuid.uuid4().hex, 8
    start = threading.Barrier(racers)
    outcomes: list[str] = []
    lock = threading.Lock()

    def race() -> None:
        start.wait(timeout=60)
        try:
            record_attempt(path, attempt, "t", "a", time.time() + 3600, time.time())
            outcome = "accepted"
        except PoolSecretError as e:
            outcome = "replay" if "a replay is refused" in str(e) else str(e)
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=race) for _ in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(outcomes) == ["accepted"] + ["replay"] * (racers - 1)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT count(*) FROM accepted_attempts").fetchone()[0] == 1


def test_attempts_long_expired_are_forgotten_and_an_unusable_record_refuses_every_segment(node):
    path, now = attempts_path(), time.time()
    old, recent = uuid.uuid4().hex, uuid.uuid4().hex
    record_attempt(path, old, "t", "a", now - CLOCK_SKEW_S - PRUNE_AFTER_S - 10, now - PRUNE_AFTER_S - 3600)
    record_attempt(path, recent, "t", "a", now - 3600, now - 3600)  # expired, kept a day: a clock stepped back stays safe
    record_attempt(path, uuid.uuid4().hex, "t", "a", now + 3600, now)
    with sqlite3.connect(path) as conn:
        kept = {row[0] for row in conn.execute("SELECT attempt_id FROM accepted_attempts")}
    assert old not in kept and recent in kept and len(kept) == 2

    blocked = node / "blocked"
    blocked.write_text("a file where the record's folder would be")
    with pytest.raises(PoolSecretError, match="record of accepted segments .* cannot be used"):
        record_attempt(blocked / "leases.db.segments", uuid.uuid4().hex, "t", "a", now + 3600, now)
