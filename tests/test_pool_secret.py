"""A pool nobody else can drive (flows/pool/secret.py): the secret file, the segments'
signatures, a node refusing an unsigned segment before it leases anything, and the pool's
Prefect server refusing a client without the auth string."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from dataclasses import asdict

import pytest

from conftest import campaign_cli, http_status
from flows.pool.secret import SECRET_ENV, PoolSecretError, init_secret, load_secret, secret_path, sign, verify


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_init_writes_a_secret_only_its_owner_reads_and_keeps_an_existing_one(folder):
    path = init_secret("lab", folder)
    assert path == folder / ".campaign" / "pool-lab.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = load_secret("lab", folder)
    assert secret.auth_string.startswith("campaign:") and len(secret.key) == 32
    with pytest.raises(PoolSecretError, match="exists: pool lab has its secret already"):
        init_secret("lab", folder)
    init_secret("lab", folder, force=True)
    assert load_secret("lab", folder).key != secret.key  # a new key: old signatures no longer verify


def test_a_missing_open_or_foreign_secret_is_refused_saying_what_to_do(folder):
    with pytest.raises(PoolSecretError, match=r"run `campaign pool init --pool lab` on the head node"):
        load_secret("lab", folder)
    path = init_secret("lab", folder)
    path.chmod(0o644)
    with pytest.raises(PoolSecretError, match="readable by other users .*`chmod 600 "):
        load_secret("lab", folder)
    path.chmod(0o600)
    path.rename(secret_path("other", folder))
    with pytest.raises(PoolSecretError, match="the secret of pool 'lab', not 'other'"):
        load_secret("other", folder)


def test_a_signature_survives_the_trip_through_prefect_and_nothing_else_verifies(folder):
    init_secret("lab", folder)
    secret = load_secret("lab", folder)
    payload = {"config": {"trial_id": "t", "lr": 1e-5, "model": {"target": "mylab.nets:make"}}, "devices": [{"id": "a/cpu0", "index": 0}],
               "span": None, "elastic": False, "node_devices": ()}
    signature = sign(secret, payload)
    verify(secret, {**payload, "node_devices": []}, signature)  # as JSON hands it back: a tuple is a list
    with pytest.raises(PoolSecretError, match="does not verify"):
        verify(secret, {**payload, "config": {**payload["config"], "model": {"target": "os:system"}}}, signature)
    with pytest.raises(PoolSecretError, match="unsigned segment"):
        verify(secret, payload, None)
    init_secret("lab", folder, force=True)
    with pytest.raises(PoolSecretError, match="does not verify"):
        verify(load_secret("lab", folder), payload, signature)


def test_a_node_refuses_an_unsigned_segment_before_it_leases_anything(folder, monkeypatch):
    """The segment flow's body, called as a worker's flow run would call it, with a forged
    config naming code to run: refused, and the node's lease file holds nothing."""
    from cluster.leases import LeaseStore
    from flows.pool.segment import trial_segment
    from training.config import TrialConfig

    path = init_secret("lab", folder)
    monkeypatch.setenv(SECRET_ENV, str(path))
    monkeypatch.setenv("CAMPAIGN_NODE", "a")
    monkeypatch.setenv("CAMPAIGN_POOL", "lab")
    monkeypatch.setenv("CAMPAIGN_LEASE_DB", str(folder / "leases.db"))
    forged = TrialConfig(trial_id="evil", seed=0, model={"target": "os:system", "kwargs": {"command": "touch pwned"}}, data={},
                         steps=1, batch_size=1, lr=0.1, trial_dir=str(folder / "evil"))
    device = {"id": "a/cpu0", "node": "a", "index": 0, "kind": "cpu", "name": "CPU core 0", "memory_bytes": 1 << 30}
    for signature in (None, "0" * 64):
        with pytest.raises(PoolSecretError):
            trial_segment.fn(asdict(forged), [device], str(folder), "someone", signature=signature)
    assert LeaseStore().leases() == [] and not (folder / "pwned").exists() and not (folder / "evil").exists()


def test_pool_init_writes_the_secret_and_a_worker_without_one_exits_2(folder):
    done = campaign_cli("pool", "init", "--pool", "lab", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert (folder / ".campaign" / "pool-lab.json").exists() and "campaign pool server --pool lab" in " ".join(done.stdout.split())
    again = campaign_cli("pool", "init", "--pool", "lab", cwd=folder)
    assert again.returncode == 2 and "has its secret already" in " ".join(again.stderr.split())
    worker = campaign_cli("worker", "--pool", "other", "--node", "n1", "--cpu-slots", "1", cwd=folder)
    assert worker.returncode == 2 and "pool other has no secret" in " ".join(worker.stderr.split())


@pytest.mark.slow
def test_the_pools_server_answers_only_clients_with_its_auth_string(folder, prefect_database):
    """`campaign pool server` is Prefect's server with the pool's auth string: a request
    without it gets 401, one with it is served."""
    import time

    from flows.servers.ui import free_port

    init_secret("lab", folder)
    secret = load_secret("lab", folder)
    port = free_port()
    prefect_database(folder / "prefect-home")
    server = subprocess.Popen([sys.executable, "-m", "flows.cli", "pool", "server", "--pool", "lab", "--host", "127.0.0.1", "--port", str(port)],
                              cwd=folder, stdout=open(folder / "server.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "PREFECT_HOME": str(folder / "prefect-home")})
    api = f"http://127.0.0.1:{port}/api"

    def get(path: str, auth: str | None) -> int:
        return http_status(api + path, auth, timeout=5)

    try:
        deadline = time.time() + 120
        while True:  # /health answers without auth: up when it does
            try:
                if get("/health", None) == 200:
                    break
            except OSError:  # not listening yet (urllib's URLError is an OSError)
                pass
            assert server.poll() is None and time.time() < deadline, (folder / "server.log").read_text()[-2000:]
            time.sleep(0.5)
        assert get("/admin/version", None) == 401
        assert get("/admin/version", "campaign:guessed") == 401
        assert get("/admin/version", secret.auth_string) == 200
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def test_a_node_leases_what_a_shared_trial_asks_and_the_signature_covers_it(folder, monkeypatch):
    """Trials that share a GPU by memory lease their share of it in the node's lease file, so
    two campaigns' 4 GiB trials hold one 16 GiB GPU together and a whole-device one waits; a
    segment whose memory was changed after it was signed is refused before it leases."""
    from cluster.leases import LeaseStore
    from cluster.types import WHOLE_DEVICE, Device
    from flows.pool.segment import node_claims, trial_segment
    from training.config import TrialConfig

    gib = 2**30
    gpu = Device("a/gpu0", "a", 0, "gpu", "GPU 0", 16 * gib)
    capacity = {gpu.id: gpu.memory_bytes}
    store = LeaseStore(folder / "leases.db")
    assert node_claims([gpu], 4 * gib) == {gpu.id: 4 * gib} and node_claims([gpu], WHOLE_DEVICE) == {gpu.id: 16 * gib}
    assert store.acquire("one/t@a:1", node_claims([gpu], 4 * gib), capacity, pid=os.getpid(), campaign="one")
    assert store.acquire("two/t@a:2", node_claims([gpu], 4 * gib), capacity, pid=os.getpid(), campaign="two")
    assert not store.acquire("three/t@a:3", node_claims([gpu], WHOLE_DEVICE), capacity, pid=os.getpid(), campaign="three")

    path = init_secret("lab", folder)
    monkeypatch.setenv(SECRET_ENV, str(path))
    monkeypatch.setenv("CAMPAIGN_NODE", "a")
    monkeypatch.setenv("CAMPAIGN_LEASE_DB", str(folder / "leases.db"))
    config = TrialConfig(trial_id="t", seed=0, model={"name": "mlp"}, data={}, steps=1, batch_size=1, lr=0.1,
                         trial_dir=str(folder / "t"))
    params = {"config": asdict(config), "devices": [asdict(gpu)], "cwd": str(folder), "campaign": "four", "span": None,
              "elastic": False, "node_devices": None, "memory_bytes": 4 * gib}
    signature = sign(load_secret("lab", folder), params)
    with pytest.raises(PoolSecretError):
        trial_segment.fn(**{**params, "memory_bytes": gib}, signature=signature)
    assert {lease.holder for lease in store.leases()} == {"one/t@a:1", "two/t@a:2"} and not (folder / "t").exists()
