"""A campaign on a pool of nodes: `campaign worker` on each, trials placed through Prefect.

Real parts: a Prefect server (as `campaign pool server` runs it), two `campaign worker` processes (each
a node with its own CPU slots and lease file, running Prefect's process worker), and
`campaign launch --pool`. One node is killed mid-trial (every process of it, as a machine
dying would); its trials finish on the other node from their checkpoints.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shlex
import shutil
from datetime import datetime, timedelta, timezone
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import http_status, running_state, stall_outside_a_lease_transaction, trainer_rank, wait_for
from cluster.inventory import declared_inventory, DeclaredNode
from cluster.types import Link
from flows.pool.nodes import PoolError, PoolNode, check_name, inventory_from_json, inventory_to_json, live, pool_inventory
from training.spec import load_spec
from flows.pool.secret import CLIENT_AUTH_ENV, SECRET_ENV, init_secret, load_secret
from flows.servers.ui import start_servers, stop_servers
from tasks.grid import expand_grid
from training.files import read_json
from training.layout import trial_files
from training.process import stop_process_groups
from training.manifest import latest_valid_checkpoint

HOLD_AT = 60
SUBNET = "10.232.{}.{}"
LABS = itertools.count()  # this process's pool labs, one after another


def test_a_node_is_live_while_its_heartbeats_come():
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    assert live(now - timedelta(seconds=14), 5, now) and not live(now - timedelta(seconds=16), 5, now)
    assert not live(None, 5, now)  # published, but its worker never beat
    assert live(now - timedelta(seconds=80), 30, now)  # a worker with a slower heartbeat


def test_the_pool_inventory_is_its_live_nodes_devices_and_survives_json():
    a = declared_inventory([DeclaredNode("a", 2, 8 * 2**30, "gpu", "A100", ((0, 1),))])
    b = declared_inventory([DeclaredNode("b", 1, 8 * 2**30, "cpu")])
    assert inventory_from_json(json.loads(json.dumps(inventory_to_json(a)))) == a  # links and all
    nodes = [PoolNode("a", "10.0.0.2", a, True, None), PoolNode("b", "10.0.0.3", b, False, None)]
    merged = pool_inventory(nodes)
    assert [d.id for d in merged.devices] == [d.id for d in a.devices] and merged.link(*[d.id for d in a.devices]) == Link.NVLINK


def test_a_patient_call_waits_out_a_server_away_and_holds_off_judging_nodes(monkeypatch):
    """Within `server_patience` a call that finds the server away is tried again until it
    answers (said once each way), and for a while after it no node is judged by its
    heartbeats; without patience, or once the campaign stops, the PoolError comes at once."""
    from flows.pool import nodes

    monkeypatch.setattr(nodes, "AWAY_POLL_S", 0.01)
    monkeypatch.setattr(nodes, "_trouble_at", float("-inf"))
    failures = iter([OSError("connection refused"), OSError("connection refused")])

    def away_twice() -> str:
        if (e := next(failures, None)) is not None:
            raise e
        return "answered"

    with pytest.raises(PoolError, match="does not answer"):
        nodes.patiently(away_twice)  # no patience: at once
    assert nodes.server_trouble_within(60.0)
    monkeypatch.setattr(nodes, "_trouble_at", float("-inf"))
    said: list[str] = []
    with nodes.server_patience(60.0, said.append):
        assert nodes.patiently(away_twice) == "answered"
    assert len(said) == 2 and said[0].endswith("waiting for it (up to 60 s)") and said[1].startswith("the Prefect server answers again")
    assert nodes.server_trouble_within(60.0) and not nodes.server_trouble_within(0.0)
    failures = iter([OSError("connection refused")] * 3)
    with nodes.server_patience(60.0, said.append, give_up=lambda: True), pytest.raises(PoolError):
        nodes.patiently(away_twice)  # the campaign stops: no waiting


def test_a_node_finds_its_interface_and_refuses_an_address_it_does_not_have(monkeypatch):
    from flows.pool.segment import ADDRESS_ENV, INTERFACE_ENV, NODE_ENV
    from flows.pool.worker import interface_of, python_here, require_server, worker_env

    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(PoolError, match="--address"):
        interface_of("192.0.2.123")  # TEST-NET-1: no machine here has it
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # whose `python`, if any, is not this one
    env = worker_env("gpu-a", "10.0.0.2", "eth1", python_here())
    assert (env[NODE_ENV], env[ADDRESS_ENV], env[INTERFACE_ENV]) == ("gpu-a", "10.0.0.2", "eth1")
    # The segment deployment's `python -m prefect.engine` runs this interpreter, in its environment.
    python = shutil.which("python", path=env["PATH"])
    try:
        assert subprocess.run([python, "-c", "import prefect, sys; print(sys.prefix)"], env=env, capture_output=True,
                              text=True).stdout.strip() == sys.prefix
    finally:
        shutil.rmtree(Path(python).parent)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with pytest.raises(PoolError, match="PREFECT_API_URL"):
        require_server()


@pytest.mark.parametrize("name", ["Node A", "-x", "a" * 64, "a/b"])
def test_bad_node_names_say_what_to_use(name):
    with pytest.raises(PoolError, match="lowercase letters, digits"):
        check_name("node", name)
    assert check_name("node", "gpu-07_b") == "gpu-07_b"


def lab_subnet_tag() -> int:
    """The third byte of this process's lab subnet, on the host's own routes: distinct for each
    of up to four workers of one test run (the workers' pool tests run side by side), and apart
    from another run's but by chance (its workers share the run's process as their parent).
    A subnet already on one of the host's interfaces is passed over: a run killed before its
    labs were torn down leaves its bridge, and two bridges on one subnet route nowhere."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit() and int(worker[2:]) < 4:
        return free_subnet_tag(os.getppid() % 62 * 4 + int(worker[2:]) + 1, 4, 248, lab_subnets_in_use())
    return free_subnet_tag(os.getpid() % 250 + 1, 1, 250, lab_subnets_in_use())


def free_subnet_tag(tag: int, step: int, top: int, taken: set[int]) -> int:
    """`tag`, or the next one in steps of `step` (wrapping within 1..`top`) not in `taken`: a
    worker's tags keep their remainder mod `step`, so the workers of one run stay apart."""
    for _ in range(top // step):
        if tag not in taken:
            return tag
        tag = (tag - 1 + step) % top + 1
    return tag  # every one taken: the lab's own setup will say what clashes


def lab_subnets_in_use() -> set[int]:
    """Third bytes of the lab subnets (SUBNET) on this host's interfaces."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    except OSError:
        return set()
    prefix = re.escape(SUBNET.split("{")[0])  # "10.232."
    return {int(m) for m in re.findall(rf"inet {prefix}(\d+)\.", out)}


def test_a_lab_passes_over_a_subnet_a_killed_run_left_on_the_host():
    """A worker's lab subnet skips those in use, in its own steps: the workers stay apart."""
    assert free_subnet_tag(6, 4, 248, set()) == 6
    assert free_subnet_tag(6, 4, 248, {6, 10}) == 14
    assert free_subnet_tag(246, 4, 248, {246}) == 2  # wraps, keeping its remainder mod 4
    assert free_subnet_tag(250, 1, 250, {250, 1}) == 2
    tags = [free_subnet_tag(5 + w, 4, 248, {5, 6, 7, 8, 9}) for w in range(4)]
    assert tags == [13, 10, 11, 12] and len(set(tags)) == 4


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def lab(tmp_path, monkeypatch, prefect_database):
    """A bridge on this host (the head: Prefect server, campaign) and two namespaces, nodes a
    and b, each with its own address on it. Skipped, saying so, where namespaces cannot be made."""
    # Names of this lab only: the kernel tears down a deleted namespace's links after
    # `ip netns del` returns, so the next pool test in this process must not reuse them.
    tag, pid = lab_subnet_tag(), f"{os.getpid() % 100000}{next(LABS)}"
    bridge, names = f"cpbr{pid}", {"a": f"pool-a{pid}", "b": f"pool-b{pid}"}
    head = SUBNET.format(tag, 1)
    try:
        ip("link", "add", bridge, "type", "bridge")
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot make a bridge and network namespaces here ({getattr(e, 'stderr', e)}): run as root with iproute2 to test a pool")
    nodes = {}
    try:
        ip("addr", "add", f"{head}/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for i, (node, ns) in enumerate(names.items(), start=2):
            inside, outside = f"cp{node}{pid}", f"cp{node}{pid}h"
            ip("netns", "add", ns)
            ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            ip("link", "set", inside, "netns", ns)
            ip("link", "set", outside, "master", bridge)
            ip("link", "set", outside, "up")
            ip("-n", ns, "addr", "add", f"{SUBNET.format(tag, i)}/24", "dev", inside)
            ip("-n", ns, "link", "set", inside, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            nodes[node] = (ns, SUBNET.format(tag, i))
        # The pool's secret (flows/pool/secret.py), as `campaign pool init` writes it: the server
        # requires its auth string; this test's processes and the nodes' workers hold the file.
        monkeypatch.delenv(SECRET_ENV, raising=False)  # the file in this test's folder, not one named from outside
        init_secret("lab", tmp_path)
        secret = load_secret("lab", tmp_path)
        monkeypatch.setenv(SECRET_ENV, str(secret.path))
        monkeypatch.setenv(CLIENT_AUTH_ENV, secret.auth_string)
        # An http URI: Prefect only; a database of its own, so no pool of an earlier run is in it.
        prefect_database(tmp_path / "prefect-head")
        servers = start_servers("http://no-mlflow-here", tmp_path / "server-logs", host=head, prefect_home=tmp_path / "prefect-head",
                                auth_string=secret.auth_string)
        try:
            yield head, servers.prefect_url + "/api", nodes
        finally:
            stop_servers(servers)
    finally:
        kill_node(None)  # whatever a test left running on any of its nodes dies with it
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def start_worker(api: str, tmp_path: Path, node: str, ns: str, address: str, slots: int, hide: Path | None = None,
                 **extra_env: str) -> subprocess.Popen:
    """`hide`: a folder this node must not see (an empty tmpfs over it in the node's own mount
    namespace, which `ip netns exec` makes), nor the other nodes' own folders; the node then
    keeps its trials in `node-<name>/`."""
    env = {**os.environ, "PREFECT_API_URL": api, "CAMPAIGN_LEASE_DB": str(tmp_path / f"leases-{node}.db"),
           "PREFECT_HOME": str(tmp_path / f"prefect-{node}"), "CAMPAIGN_NODE_MARK": node_mark(node), **extra_env}
    command = [sys.executable, "-m", "flows.cli", "worker", "--pool", "lab", "--node", node, "--address", address,
               "--cpu-slots", str(slots)]
    if hide is not None:
        hidden = [hide, *(tmp_path / f"node-{other}" for other in ("a", "b") if other != node)]
        for folder in hidden:
            folder.mkdir(exist_ok=True)
        mounts = " && ".join(f"mount -t tmpfs tmpfs {shlex.quote(str(folder))}" for folder in hidden)
        command = ["sh", "-c", f'{mounts} && exec "$@"', "worker", *command, "--work-dir", str(tmp_path / f"node-{node}")]
    return subprocess.Popen(["ip", "netns", "exec", ns, *command],
                            env=env, stdout=open(tmp_path / f"worker-{node}.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def start_live_worker(api: str, tmp_path: Path, node: str, ns: str, address: str, slots: int, hide: Path | None = None,
                      **extra_env: str) -> subprocess.Popen:
    """A node's worker, once the pool sees it beating."""
    from prefect.settings import temporary_settings

    worker = start_worker(api, tmp_path, node, ns, address, slots, hide, **extra_env)
    with temporary_settings(updates=pool_settings(api)):
        wait_for(lambda: any(n.name == node and n.live for n in nodes_once_made("lab")), 120, f"node {node} live")
    return worker


def pool_settings(api: str) -> dict:
    """This process's Prefect settings for the lab's server: its address and the pool's auth
    (Prefect read its settings when first imported, before the lab existed)."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

    return {PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: os.environ[CLIENT_AUTH_ENV]}


def end_launch_and_workers(launch: subprocess.Popen | None, workers) -> None:
    """What a test leaves running: the campaign killed, every node's worker stopped in order."""
    if launch is not None and launch.poll() is None:
        launch.kill()
    for proc in workers:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in workers:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def listening(ns: str) -> set[str]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines()}


def node_mark(node: str) -> str:
    """A node's mark in its processes' environment: this test process's own (the suite runs
    tests side by side, and another test's nodes are named a and b too)."""
    return f"{node}@{os.getpid()}"


def kill_node(node: str | None) -> None:
    """SIGKILL every process of a node (None: of every node this test process started), at once, as a machine dying."""
    for pid in processes_of(node):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def processes_of(node: str | None) -> list[int]:
    """Every process of a node (None: of every node this test process started): they all
    inherit its mark (the worker, its flow runs, their trials)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                marks = [e for e in (proc / "environ").read_bytes().split(b"\0") if e.startswith(b"CAMPAIGN_NODE_MARK=")]
            except OSError:
                continue
            mark = marks[0].decode().split("=", 1)[1] if marks else ""
            if mark == node_mark(node) if node else mark.endswith(f"@{os.getpid()}"):
                found.append(int(proc.name))
    return found


def nodes_once_made(pool: str) -> list[PoolNode]:
    """The pool's nodes; none until the first worker has made the pool."""
    from flows.pool.remote import pool_nodes

    try:
        return pool_nodes(pool)
    except PoolError as e:
        assert "there is no pool" in str(e), e
        return []


@pytest.mark.slow
@pytest.mark.waits
@pytest.mark.parametrize("shared", [True, False], ids=["shared folder", "nothing shared"])
def test_pool_runs_trials_on_its_nodes_one_across_both_and_a_dead_nodes_trial_finishes_elsewhere(tmp_path, digits_npz, lab, monkeypatch,
                                                                                                  shared):
    """Node a has 3 CPU slots, node b 1; the campaign's two 2-device trials start at once, one
    on a, one across a and b (torchrun's c10d rendezvous). Node b dies while both are held at
    a step: the trial it was part of goes on without it; node b's worker starts again and the
    trial takes it back in, from its checkpoint, and ends across both (never queued again).
    Nothing shared: node b, back, copies its files through a new artifact and pulls the
    checkpoint rank 0 wrote on node a from the DVC remote."""
    from prefect.settings import temporary_settings

    head, api, nodes = lab
    monkeypatch.setenv("PREFECT_API_URL", api)  # for the processes this test starts
    workers = {}
    with temporary_settings(updates=pool_settings(api)), campaign_folder(tmp_path, head, shared) as (folder, apart, hide):
        run_pool_campaign(tmp_path, digits_npz, api, nodes, workers, folder, apart, hide)


def run_pool_campaign(tmp_path, digits_npz, api, nodes, workers, folder, apart, hide) -> None:
    from conftest import campaign_cli

    before = campaign_cli("cluster", "--pool", "lab")  # no worker has made the pool yet: said so, no traceback
    said = " ".join((before.stdout + before.stderr).split())
    assert before.returncode != 0 and "there is no pool 'lab'" in said and "Traceback" not in said, said
    launch = None
    try:
        for node, slots in (("a", 3), ("b", 1)):
            ns, address = nodes[node]
            workers[node] = start_worker(api, tmp_path, node, ns, address, slots, hide=hide)
        seen = wait_for(lambda: (n := nodes_once_made("lab")) and len(n) == 2 and all(x.live for x in n) and n, 120, "both nodes live")
        assert [(n.name, n.address, len(n.inventory.devices)) for n in seen] == [("a", nodes["a"][1], 3), ("b", nodes["b"][1], 1)]
        assert {d.id for d in pool_inventory(seen).devices} == {"a/cpu0", "a/cpu1", "a/cpu2", "b/cpu0"}
        shown = subprocess.run([sys.executable, "-m", "flows.cli", "cluster", "--pool", "lab"], capture_output=True, text=True,
                               env={**os.environ, "COLUMNS": "200"}, timeout=60)
        assert "2 of 2 node(s) live" in shown.stdout and "b/cpu0" in shown.stdout, shown.stdout + shown.stderr

        params = folder / "params.yaml"
        params.write_text(yaml.safe_dump({
            "campaign": {"name": "pooled", "seed": 3}, "data": {"path": str(digits_npz)},
            "model": {"name": "mlp", "width": 16},
            "training": {"steps": 150, "batch_size": 32, "lr": 0.05, "checkpoint_every": 50, "eval_every": 150, "log_every": 10},
            "grid": {"training.lr": [0.02, 0.05]},
            "resources": {"devices": 2},
            "tracking": {"mlflow_uri": f"sqlite:///{folder / 'mlflow.db'}", "experiment": "pooled",
                         "runs_dir": str(folder / "runs"), "summary": str(folder / "summary.json"), **(apart or {})},
            **({"cluster": {"shared_storage": False}} if apart else {}),
        }))
        runs = folder / "runs" / "pooled"
        trial_ids = [t.id for t in expand_grid(load_spec(params, pool="lab"))]
        for trial_id in trial_ids:  # every trial waits at HOLD_AT while its hold file is there
            (runs / trial_id).mkdir(parents=True, exist_ok=True)
            trial_files(runs / trial_id).hold.touch()
        launch = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "launch", str(params), "--pool", "lab", "--no-live"], cwd=folder,
            env={**os.environ, "CAMPAIGN_HOLD_AT_STEP": str(HOLD_AT), "CAMPAIGN_LEASE_DB": str(tmp_path / "leases-head.db")},
            stdout=open(tmp_path / "launch.log", "wb"), stderr=subprocess.STDOUT)

        def launch_log() -> str:
            return (tmp_path / "launch.log").read_text(errors="replace")[-4000:]

        def held() -> dict[str, list[str]]:
            out = {}
            for trial_id in trial_ids:
                if (read_json(runs / trial_id / "progress.json") or {}).get("state") == "held":
                    out[trial_id] = (read_json(runs / trial_id / "record.json") or {}).get("devices", [])
            if launch.poll() is not None:
                pytest.fail(f"the campaign ended early:\n{launch_log()}")
            return out if len(out) == 2 else {}

        placed = wait_for(held, 300, "both trials held")
        across = next(t for t, devices in placed.items() if any(d.startswith("b/") for d in devices))
        alone = next(t for t in trial_ids if t != across)
        # The host node keeps the record of a trial across nodes: every device of it, node a's first.
        assert len(placed[across]) == 2 and placed[across][0].startswith("a/") and placed[across][1] == "b/cpu0", placed
        assert len(placed[alone]) == 2 and all(d.startswith("a/") for d in placed[alone]), placed

        # While they are held, each node listens only on its own address (or its own loopback).
        for node, (ns, address) in nodes.items():
            assert listening(ns) <= {address, "127.0.0.1"}, (node, listening(ns))
        assert any(address == nodes["a"][1] for address in listening(nodes["a"][0]))  # the rendezvous store, on the host node

        # Each node's workers watch their own node's lease, named in a config of the node's own
        # (in a shared folder, one config for both once named node b's lease on node a too).
        on = lambda node: runs / across if apart is None else tmp_path / f"node-{node}" / "pooled" / across  # noqa: E731
        assert "@a:" in read_json(on("a") / "trial.json")["lease"]["holder"]
        assert "@b:" in read_json(on("b") / "trial-b.json")["lease"]["holder"]
        # The checkpoint at step 50 is saved in the background: held at 60, the trial may still be
        # writing it. Node b dies once it is in view where rank 0 writes it (nothing shared: and
        # on the DVC remote, where node b, back, pulls it from), as a resume from 50 needs.
        rank0_checkpoints = on("a") / "checkpoints"
        wait_for(lambda: (found := latest_valid_checkpoint(rank0_checkpoints)) is not None and found.name == "step-00000050"
                 and (apart is None or (tmp_path / "remote" / "index" / "pooled" / across / "step-00000050.json").exists()),
                 120, "the checkpoint at step 50 in view")
        kill_node("b")  # node b dies: its worker, flow runs and trial processes, at once
        said = lambda: " ".join((tmp_path / "launch.log").read_text(errors="replace").split())  # noqa: E731
        wait_for(lambda: f"trial {across}: node b stopped beating; it goes on without it" in said(), 120, "node b left behind")
        # Node b comes back (its worker started again): the trial takes it in again. Held at its
        # step on node a, the trial's agent there restarts with node b from the checkpoint at 50.
        workers["b"] = start_worker(api, tmp_path, "b", *nodes["b"], 1, hide=hide, CAMPAIGN_NODE_MARK=node_mark("b-again"))
        wait_for(lambda: f"trial {across}: node b is back; it takes the node in again" in said(), 120, "node b taken back")
        train_log = runs / across / "train.log"
        wait_for(lambda: "world size 2, resumed at step 50" in train_log.read_text(), 180, "the trial on both nodes again")
        for trial_id in trial_ids:
            trial_files(runs / trial_id).hold.unlink()
        assert launch.wait(timeout=300) == 0, launch_log()

        for trial_id in trial_ids:
            result = read_json(runs / trial_id / "result.json")
            assert result is not None and result["steps"] == 150, (trial_id, launch_log())
        result = read_json(runs / across / "result.json")
        assert result["resumed_from_step"] == 50, result  # its checkpoint, written by ranks on both nodes (nothing shared: by rank 0)
        if apart is not None:  # the metrics went to the MLflow server; no checkpoint came to the campaign's folder
            from mlflow import MlflowClient

            from tasks.tracking import TRIAL_TAG

            client = MlflowClient(apart["mlflow_uri"])
            runs_found = client.search_runs([client.get_experiment_by_name("pooled").experiment_id])
            assert {r.data.tags.get(TRIAL_TAG) for r in runs_found if "train_loss" in r.data.metrics} == set(trial_ids), runs_found
            assert not any((runs / t / "checkpoints").exists() for t in trial_ids)
            assert (tmp_path / "node-b" / "pooled" / across / "checkpoints" / "step-00000050").is_dir()  # pulled, never written there
        # Where it was, without node b and then with it again: never queued again.
        events = [e for e in map(json.loads, (runs / "allocations.jsonl").read_text().splitlines()) if e["trial"] == across]
        assert [e["reason"] for e in events] == ["start", "node left", "node back", "end"], events
        assert events[1]["devices"] == placed[across][:1] and events[2]["devices"] == placed[across], events
        assert "NodeLost" not in launch_log()
        assert not processes_of("b")
    finally:
        end_launch_and_workers(launch, workers.values())


def launch_held(tmp_path: Path, digits_npz: Path, api: str, name: str) -> tuple[Path, Path, dict, subprocess.Popen]:
    """`campaign launch --pool lab` of one 2-device trial, returned once the trial is held at
    HOLD_AT on its node: (params, the trial's folder, the launch's environment less the
    hold, the launch)."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "campaign": {"name": name, "seed": 3}, "data": {"path": str(digits_npz)}, "model": {"name": "mlp", "width": 8},
        "training": {"steps": 150, "batch_size": 32, "lr": 0.05, "checkpoint_every": 50},
        "resources": {"devices": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": name,
                     "runs_dir": str(tmp_path / "runs"), "summary": str(tmp_path / "summary.json")},
    }))
    (trial_id,) = [t.id for t in expand_grid(load_spec(params))]
    trial_dir = tmp_path / "runs" / name / trial_id
    trial_dir.mkdir(parents=True)
    trial_files(trial_dir).hold.touch()
    env = {**os.environ, "PREFECT_API_URL": api, "CAMPAIGN_LEASE_DB": str(tmp_path / "leases-head.db")}
    launch = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "launch", str(params), "--pool", "lab", "--no-live"], cwd=tmp_path,
        env={**env, "CAMPAIGN_HOLD_AT_STEP": str(HOLD_AT)}, stdout=open(tmp_path / "launch.log", "wb"), stderr=subprocess.STDOUT)
    wait_for(lambda: (read_json(trial_dir / "progress.json") or {}).get("state") == "held"
             or (launch.poll() is not None and pytest.fail((tmp_path / "launch.log").read_text()[-3000:])), 240, "the trial held")
    return params, trial_dir, env, launch


@pytest.mark.slow
@pytest.mark.waits
def test_a_stopped_campaign_stops_its_trials_on_the_nodes(tmp_path, digits_npz, lab):
    """SIGTERM to `campaign launch` while a trial runs on a node: the trial's flow run is
    cancelled, its processes on the node end and the node's lease of its devices goes."""
    from cluster.leases import LeaseStore

    head, api, nodes = lab
    ns, address = nodes["a"]
    worker = start_live_worker(api, tmp_path, "a", ns, address, 2)
    launch = None
    try:
        _, _, _, launch = launch_held(tmp_path, digits_npz, api, "stopped")
        node_leases = LeaseStore(tmp_path / "leases-a.db")
        assert {lease.device_id for lease in node_leases.leases()} == {"a/cpu0", "a/cpu1"}
        trial_pids = trial_processes("a")
        assert trial_pids

        launch.send_signal(signal.SIGTERM)
        assert launch.wait(timeout=120) == 143, (tmp_path / "launch.log").read_text()[-3000:]
        try:
            wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in trial_pids), 60, "the trial's processes on node a to end")
        except AssertionError:
            left = subprocess.run(["ps", "-o", "pid,ppid,stat,args", "-p", ",".join(map(str, trial_pids))], capture_output=True, text=True)
            raise AssertionError(f"left on node a:\n{left.stdout}") from None
        wait_for(lambda: not node_leases.leases(), 60, "node a's lease to go")
        assert worker.poll() is None  # the node itself goes on serving the pool
    finally:
        end_launch_and_workers(launch, [worker])


@pytest.mark.slow
@pytest.mark.waits
def test_a_killed_campaigns_segment_is_ended_before_its_trial_is_launched_again(tmp_path, digits_npz, lab):
    """SIGKILL to `campaign launch` leaves its trial's segment training on the node (it lives
    there, not in the campaign's process). Launched again, the campaign cancels that segment
    and waits for it to end before it sends the trial again: never two copies of the trial,
    and the node's devices are free for the new one, which finishes from the checkpoint."""
    head, api, nodes = lab
    ns, address = nodes["a"]
    worker = start_live_worker(api, tmp_path, "a", ns, address, 2)
    launch = None
    try:
        params, trial_dir, env, launch = launch_held(tmp_path, digits_npz, api, "twice")
        trial_pids = trial_processes("a")
        assert trial_pids
        launch.kill()
        launch.wait(timeout=60)
        assert all(Path(f"/proc/{pid}").exists() for pid in trial_pids)  # the segment trains on, held, on node a

        again = subprocess.run([sys.executable, "-m", "flows.cli", "launch", str(params), "--pool", "lab", "--no-live"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        said = again.stdout + again.stderr
        assert again.returncode == 0, said[-4000:]
        assert "from an earlier launch is still running" in said, said[-4000:]
        assert not any(Path(f"/proc/{pid}").exists() for pid in trial_pids)
        result = read_json(trial_files(trial_dir).result)
        assert result["steps"] == 150 and result["resumed_from_step"] == 50  # from the killed launch's checkpoint
    finally:
        end_launch_and_workers(launch, [worker])


def cut_off(ns: str) -> None:
    """The node's network down (its link to the head), its processes and the folders it
    shares left as they are: a node alive but cut off from the campaign."""
    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    for name in (line.split(":")[1].strip().split("@")[0] for line in out.splitlines()):
        if name != "lo":
            ip("-n", ns, "link", "set", "dev", name, "down")


def node_processes(node: str | None, part: bytes) -> list[int]:
    """The node's processes whose command line holds `part` (one that ends meanwhile is not)."""
    found = []
    for pid in processes_of(node):
        with contextlib.suppress(OSError):
            if part in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def trial_processes(node: str | None) -> list[int]:
    return node_processes(node, b"training.")


@pytest.mark.slow
@pytest.mark.waits
def test_a_node_cut_off_but_alive_stops_its_segment_once_the_trial_is_launched_again(tmp_path, digits_npz, lab):
    """The node holding the trial loses its network to the head, not its shared folder, nor
    its own lease file: the campaign sees it dead and launches the trial on the other node,
    and the cut-off node's processes stop themselves (the folder's launch is no longer theirs)
    instead of training on into the trial's folder beside the new ones."""
    head, api, nodes = lab
    workers = [start_live_worker(api, tmp_path, node, *nodes[node], 2) for node in ("a", "b")]
    launch = None
    try:
        _, trial_dir, _, launch = launch_held(tmp_path, digits_npz, api, "cut")
        first = next(node for node in ("a", "b") if trial_processes(node))
        other = "b" if first == "a" else "a"
        stale = trial_processes(first)
        cut_off(nodes[first][0])
        wait_for(lambda: trial_processes(other), 180, f"the trial launched again on node {other}")
        wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in stale), 60,
                 f"the trial's processes on the cut-off node {first} to stop")
        assert "the trial was launched again" in trial_files(trial_dir).log.read_text()
        trial_files(trial_dir).hold.unlink()
        assert launch.wait(timeout=300) == 0, (tmp_path / "launch.log").read_text()[-3000:]
        result = read_json(trial_files(trial_dir).result)
        assert result["steps"] == 150 and result["resumed_from_step"] == 50
    finally:
        end_launch_and_workers(launch, workers)


def stop_prefect_server(port: int) -> None:
    """SIGTERM to the lab's Prefect server (each in a session of its own), waited for."""
    leaders = [int(proc.name) for proc in Path("/proc").iterdir() if proc.name.isdigit() and _cmdline_has(proc, b"flows.servers.warmup", f"{port}".encode())]
    for pid in leaders:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    wait_for(lambda: not any(_cmdline_has(Path(f"/proc/{pid}"), b"warmup") for pid in leaders), 60, "the Prefect server to stop")


def _cmdline_has(proc: Path, *parts: bytes) -> bool:
    try:
        args = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return all(part in args or any(arg.endswith(part) for arg in args) for part in parts)


def segment_runs(api: str, campaign: str, trial_id: str) -> list:
    """The flow runs of the trial's segments, as the lab's server has them."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.settings import temporary_settings

    from flows.pool.nodes import call
    from flows.pool.remote import segment_tag

    with temporary_settings(updates=pool_settings(api)):
        return call(lambda client: client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[segment_tag(campaign, trial_id)]))))


def restart_prefect_server(tmp_path: Path, head: str, api: str, launch: subprocess.Popen):
    """Stop the lab's Prefect server until the campaign's loop that follows its trial has
    missed it (its own words: the pool look's "does not answer" can come first, while the
    loop's call still rides on its client's retries), then start it again on its port and
    database; the servers started."""
    port = int(api.rsplit(":", 1)[1].split("/")[0])
    stop_prefect_server(port)
    log = tmp_path / "launch.log"
    wait_for(lambda: "waiting for it (up to" in log.read_text() or launch.poll() is not None, 300,
             "the campaign's loop that follows the trial to miss the server")
    assert launch.poll() is None, log.read_text()[-3000:]
    return start_servers("http://no-mlflow-here", tmp_path / "server-logs-again", prefect_port=port, host=head,
                         prefect_home=tmp_path / "prefect-head", auth_string=os.environ[CLIENT_AUTH_ENV])


@pytest.mark.slow
@pytest.mark.waits
def test_a_campaign_stopped_after_a_prefect_server_restart_still_stops_its_trial_on_the_node(tmp_path, digits_npz, lab):
    """The pool's Prefect server stops for a minute and starts again while a trial trains on
    node a. Prefect's worker there then no longer ends that run when it is cancelled (the
    observer it made for the run gives up for good after three failed polls). SIGTERM to the campaign still ends the
    trial's processes on the node and releases its lease there: the segment watches its own
    run, stops its trial itself, and its run ends Cancelled."""
    from cluster.leases import LeaseStore

    head, api, nodes = lab
    worker = start_live_worker(api, tmp_path, "a", *nodes["a"], 2)
    launch, restarted = None, None
    try:
        _, trial_dir, _, launch = launch_held(tmp_path, digits_npz, api, "restop")
        pids = trial_processes("a")
        restarted = restart_prefect_server(tmp_path, head, api, launch)
        log = tmp_path / "launch.log"
        wait_for(lambda: "answers again" in log.read_text() or launch.poll() is not None, 300, "the campaign to find the server back")
        assert launch.poll() is None, log.read_text()[-3000:]
        launch.send_signal(signal.SIGTERM)
        assert launch.wait(timeout=120) == 143, log.read_text()[-3000:]
        # The segment's watch leaves the cancel to the worker for a minute first.
        wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 240, "the trial's processes on node a to end")
        wait_for(lambda: not LeaseStore(tmp_path / "leases-a.db").leases(), 60, "node a's lease to go")
        (segment,) = wait_for(lambda: [run for run in segment_runs(api, "restop", trial_dir.name) if run.state.is_final()], 120,
                              "the segment's run to end")
        assert segment.state.is_cancelled(), segment.state
        assert "stopped by the segment itself" in (tmp_path / "worker-a.log").read_text(errors="replace")
        assert worker.poll() is None  # the node goes on serving the pool
    finally:
        end_launch_and_workers(launch, [worker])
        if restarted is not None:
            stop_servers(restarted)


@pytest.mark.slow
@pytest.mark.waits
def test_a_trial_on_a_node_rides_out_a_prefect_server_restart(tmp_path, digits_npz, lab):
    """The pool's Prefect server stops for longer than its client's own retries cover (a
    crash, a restart of the host's service), and starts again on the same port and database.
    The trial's segment trains on meanwhile; the campaign waits for the server instead of
    failing the trial (and leaving its segment training with nobody following it), and takes
    no node for dead while its heartbeats had nowhere to go. The trial finishes while the
    server is still away: its segment waits for the server to report its end (else its worker
    later reports the run crashed, and with nothing shared its last files are never sent),
    and the campaign collects the trial, never restarted."""
    head, api, nodes = lab
    port = int(api.rsplit(":", 1)[1].split("/")[0])
    worker = start_live_worker(api, tmp_path, "a", *nodes["a"], 2)
    launch, restarted = None, None
    try:
        _, trial_dir, _, launch = launch_held(tmp_path, digits_npz, api, "outage")
        pids = trial_processes("a")
        stop_prefect_server(port)
        log = tmp_path / "launch.log"
        # The loop that follows the trial's segments says it waits (its words, not the pool
        # look's "does not answer", which can come first while the loop's own call still rides
        # on its client's retries and would then not have met the outage at all).
        wait_for(lambda: "waiting for it (up to" in log.read_text() or launch.poll() is not None, 300,
                 "the campaign's loop that follows the trial to miss the server")
        assert launch.poll() is None, log.read_text()[-3000:]
        assert all(Path(f"/proc/{pid}").exists() for pid in pids)  # trained on, held, through the outage
        trial_files(trial_dir).hold.unlink()
        wait_for(lambda: not trial_processes("a"), 120, "the trial to end while the server is away")
        # Its segment then waits for the server (it says so), or, if it did not, has given up
        # reporting its end and gone, as the flow run's process did before it waited.
        worker_log = tmp_path / "worker-a.log"
        wait_for(lambda: "waiting for it (up to" in worker_log.read_text(errors="replace")
                 or not node_processes("a", b"prefect.engine"),
                 300, "the segment to wait for the server, or to end")
        restarted = start_servers("http://no-mlflow-here", tmp_path / "server-logs-again", prefect_port=port, host=head,
                                  prefect_home=tmp_path / "prefect-head", auth_string=os.environ[CLIENT_AUTH_ENV])
        assert launch.wait(timeout=300) == 0, log.read_text()[-3000:]
        result = read_json(trial_files(trial_dir).result)
        assert result["steps"] == 150 and result["resumed_from_step"] == 0, result  # never restarted
        assert "answers again" in log.read_text()
        # Its end reported by the segment itself: not a run its worker later found crashed.
        (segment,) = segment_runs(api, "outage", trial_dir.name)
        assert segment.state.is_completed(), segment.state
    finally:
        end_launch_and_workers(launch, [worker])
        if restarted is not None:
            stop_servers(restarted)


@pytest.mark.slow
@pytest.mark.waits
def test_a_trial_across_nodes_that_stalls_is_stopped_on_every_node_and_failed(tmp_path, digits_npz, lab):
    """No node's own watchdog can judge a trial over two nodes (rank 0 writes its progress on
    one of them); the campaign does, from its copy of the progress: past the limit every
    segment is cancelled, the trial's processes end on both nodes, their leases go, and the
    trial fails for good with the stall as its reason."""
    from tasks.records import read_trial_record
    from user_workload import PACKAGE, write_package
    from cluster.leases import LeaseStore

    head, api, nodes = lab
    workers = [start_live_worker(api, tmp_path, node, *nodes[node], 1) for node in ("a", "b")]
    try:
        write_package(tmp_path)
        params = tmp_path / "params.yaml"
        params.write_text(yaml.safe_dump({
            "campaign": {"name": "hung", "seed": 3}, "data": {"path": str(digits_npz)},
            "model": {"target": f"{PACKAGE}.nets:stalls_at", "kwargs": {"step": 3}},
            "training": {"steps": 30, "batch_size": 16, "lr": 0.05, "checkpoint_every": 10, "stall_timeout_s": 20},
            "resources": {"devices": 2},
            "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "hung",
                         "runs_dir": str(tmp_path / "runs"), "summary": str(tmp_path / "summary.json")},
        }))
        (trial_id,) = [t.id for t in expand_grid(load_spec(params, pool="lab"))]
        launch = subprocess.run([sys.executable, "-m", "flows.cli", "launch", str(params), "--pool", "lab", "--no-live"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=600,
                                env={**os.environ, "PREFECT_API_URL": api, "CAMPAIGN_LEASE_DB": str(tmp_path / "leases-head.db")})
        said = launch.stdout[-4000:] + launch.stderr[-4000:]
        assert launch.returncode != 0, said
        record = read_trial_record(tmp_path / "runs" / "hung" / trial_id)
        assert record.state == "failed" and record.reason.startswith("stalled at step"), (record, said)
        assert record.attempts == 1, said  # not retried into the same hang
        wait_for(lambda: not trial_processes("a") + trial_processes("b"), 60, "the trial's processes to end")
        for node in ("a", "b"):
            assert not LeaseStore(tmp_path / f"leases-{node}.db").leases(), node
    finally:
        end_launch_and_workers(None, workers)


@pytest.mark.slow
@pytest.mark.waits
def test_nobody_without_the_pools_secret_runs_code_on_a_node(tmp_path, lab):
    """The lab's server requires the pool's auth string, and node a's real worker serves it.
    A flow run of the pool's deployment asked for without the auth string, or with a wrong
    one, is refused by the server (401) and never made. Asked for with the auth string but a
    config that names code to run (`model.target`: os:system), unsigned or signed and then
    changed, it reaches the node's worker, whose segment refuses it before anything else:
    the flow run fails saying why, nothing ran, no trial folder was made and node a's lease
    file holds nothing."""
    from dataclasses import asdict

    from prefect.deployments import run_deployment
    from prefect.settings import temporary_settings

    from cluster.leases import LeaseStore
    from flows.pool.nodes import call
    from flows.pool.remote import prepare_pool
    from flows.pool.secret import sign
    from training.config import TrialConfig

    head, api, nodes = lab
    ns, address = nodes["a"]
    worker = start_live_worker(api, tmp_path, "a", ns, address, 1)
    pwned, evil_dir = tmp_path / "pwned", tmp_path / "evil"
    forged = TrialConfig(trial_id="evil", seed=0, model={"target": "os:system", "kwargs": {"command": f"touch {pwned}"}}, data={},
                         steps=1, batch_size=1, lr=0.1, trial_dir=str(evil_dir))
    device = {"id": "a/cpu0", "node": "a", "index": 0, "kind": "cpu", "name": "CPU core 0", "memory_bytes": 1 << 30}
    params = {"config": asdict(forged), "devices": [device], "cwd": str(tmp_path), "campaign": "intruder", "span": None,
              "elastic": False, "node_devices": [device]}
    try:
        with temporary_settings(updates=pool_settings(api)):
            deployment = prepare_pool("lab")
            deployment_id = call(lambda client: client.read_deployment_by_name(deployment)).id

            def create_flow_run(auth: str | None) -> int:
                return http_status(f"{api}/deployments/{deployment_id}/create_flow_run", auth,
                                   {"parameters": params, "work_queue_name": "a"})

            assert create_flow_run(None) == 401
            assert create_flow_run("campaign:guessed") == 401
            assert call(lambda client: client.read_flow_runs()) == []  # neither was made

            # Signed by the pool's key for a harmless model, then the model swapped on the way.
            signature = sign(load_secret("lab"), {**params, "config": {**params["config"], "model": {"name": "mlp"}}})
            sent = {"unsigned segment": run_deployment(deployment, parameters=params, work_queue_name="a", timeout=0),
                    "does not verify": run_deployment(deployment, parameters={**params, "signature": signature},
                                                      work_queue_name="a", timeout=0)}

            def ended(run_id):
                state = call(lambda client: client.read_flow_run(run_id)).state
                return state if state is not None and state.is_final() else None

            for why, run in sent.items():
                state = wait_for(lambda: ended(run.id), 180, f"the flow run refused for {why!r} to end on node a")
                assert state.is_failed() and why in " ".join((state.message or "").split()), (why, state)
        assert not pwned.exists() and not evil_dir.exists()
        assert LeaseStore(tmp_path / "leases-a.db").leases() == []
        assert worker.poll() is None  # the node goes on serving the pool
    finally:
        end_launch_and_workers(None, [worker])


def start_mlflow_server(folder: Path, host: str) -> tuple[subprocess.Popen, str]:
    """An MLflow server on the head's address, its store in `folder` (the nodes reach it over the network)."""
    from flows.servers.ui import MLFLOW_SERVER_ENV, free_port, healthy

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port), "--workers", "1",
                               "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"], cwd=folder, env={**os.environ, **MLFLOW_SERVER_ENV},
                              stdout=open(folder / "mlflow-server.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{host}:{port}"
    wait_for(lambda: healthy(url + "/health") or (server.poll() is not None and pytest.fail((folder / "mlflow-server.log").read_text())),
             120, "the MLflow server")
    return server, url


@contextlib.contextmanager
def campaign_folder(tmp_path: Path, head: str, shared: bool):
    """The campaign's folder and what its spec's tracking adds: with a shared folder, the
    test's own (the nodes see it); with nothing shared, `head/`, which `start_worker(hide=...)`
    hides from the nodes, an MLflow server on the head's address and a DVC directory remote.
    Yields (folder, tracking settings, the folder to hide or None)."""
    if shared:
        yield tmp_path, None, None
        return
    folder = tmp_path / "head"
    folder.mkdir()
    (tmp_path / "remote").mkdir()
    server, url = start_mlflow_server(folder, head)
    try:
        yield folder, {"mlflow_uri": url, "dvc_remote": str(tmp_path / "remote")}, folder
    finally:
        # Not under test: MLflow's server once took more than 30 s to stop after its uvicorn
        # worker had finished, so what is left of it after the grace is killed.
        stop_process_groups([server.pid], grace_s=30)
        server.wait(timeout=30)


def elastic_campaign(tmp_path: Path, digits: Path, name: str, training: dict, apart: dict | None = None) -> tuple[Path, str, Path]:
    """A campaign of one elastic [1, 2] trial that the test resizes (`min_run_s` 600: the policy
    neither shrinks nor moves it on its own, though it grows it into idle devices): its params
    file, the trial's id and its folder. `apart`: the tracking settings of a pool without a
    shared folder (its MLflow server and DVC remote). Ordered by attained service, which reads
    no lengths: a test that holds its trial makes its declared steps say nothing of its run to
    come (300 steps held at step 60 end, by them, in about a second, and a policy that reads
    them would rightly not grow it onto a joining node)."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({
        "campaign": {"name": name, "seed": 3}, "data": {"path": str(digits)}, "model": {"name": "mlp", "width": 8},
        "training": {"batch_size": 32, "lr": 0.05, **training},
        "resources": {"devices": [1, 2]},
        "scheduling": {"resize_pause_s": 1.0, "min_run_s": 600.0, "order": "attained"},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": name,
                     "runs_dir": str(tmp_path / "runs"), "summary": str(tmp_path / "summary.json"), **(apart or {})},
        **({"cluster": {"shared_storage": False}} if apart else {}),
    }))
    (trial_id,) = [t.id for t in expand_grid(load_spec(params, pool="lab"))]
    return params, trial_id, tmp_path / "runs" / name / trial_id


@pytest.mark.slow
@pytest.mark.waits
@pytest.mark.parametrize("shared", [True, False], ids=["shared folder", "nothing shared"])
def test_an_elastic_trial_in_a_pool_is_resized_on_its_node_and_moves_when_the_node_dies(tmp_path, digits_npz, lab, shared):
    """An elastic [1, 2] trial in a pool runs on one node and is resized by hand there. Its
    node's lease file follows its size; a grow onto a device that file gives to another
    campaign (one the head does not know about) is refused, and the request answered so.
    A node that joins mid-campaign is seen; when the trial's node dies, the trial resumes
    there from its last checkpoint (the hand-set size was for the node it lost).
    Nothing shared: the nodes do not see the campaign's folder (`start_worker(hide=...)`):
    the resize commands, the agent's state and the refusal travel through Prefect, the
    checkpoint through the DVC remote."""
    head, api, nodes = lab
    with campaign_folder(tmp_path, head, shared) as (folder, apart, hide):
        run_elastic_pool_campaign(tmp_path, digits_npz, api, nodes, folder, apart, hide)


def run_elastic_pool_campaign(tmp_path, digits_npz, api, nodes, folder, apart, hide) -> None:
    from cluster.leases import LeaseStore
    from training.checkpoint_remote import CheckpointRemote

    shared = apart is None
    ns, address = nodes["a"]
    worker = start_live_worker(api, tmp_path, "a", ns, address, 2, hide=hide)
    launch = worker_b = None
    runs = folder / "runs"
    try:
        # Stopped by the test; held from step 510 (its first checkpoint, at 500, made) at every
        # control step while its hold file is there: it answers resizes, and trains no more.
        params, trial_id, trial_dir = elastic_campaign(folder, digits_npz, "elastic", {"steps": 10**6, "checkpoint_every": 500}, apart)
        trial_dir.mkdir(parents=True)
        trial_files(trial_dir).hold.touch()
        launch = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "launch", str(params), "--pool", "lab", "--no-live"], cwd=folder,
            env={**os.environ, "PREFECT_API_URL": api, "CAMPAIGN_LEASE_DB": str(tmp_path / "leases-head.db"),
                 "CAMPAIGN_HOLD_AT_STEP": "510"},
            stdout=open(tmp_path / "launch.log", "wb"), stderr=subprocess.STDOUT)
        node_leases = LeaseStore(tmp_path / "leases-a.db")

        def leased() -> set[str]:
            return {lease.device_id for lease in node_leases.leases()}

        def running_on(count: int) -> bool:
            if launch.poll() is not None:
                pytest.fail((tmp_path / "launch.log").read_text()[-3000:])
            state = read_json(trial_dir / "control" / "state.json") or {}
            return state.get("status") == "running" and len(state.get("devices", [])) == count

        def resize(devices: int) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "flows.cli", "resize", trial_id, str(devices), "--runs-dir", str(runs),
                                   "--wait-s", "120"], capture_output=True, text=True, timeout=150, cwd=folder)

        wait_for(lambda: running_on(2), 240, "the trial on both devices of node a")
        assert leased() == {"a/cpu0", "a/cpu1"}
        shrunk = resize(1)
        assert shrunk.returncode == 0, shrunk.stdout + shrunk.stderr
        (kept,) = read_json(trial_dir / "control" / "state.json")["devices"]
        wait_for(lambda: leased() == {kept}, 30, "node a's lease to follow the shrink")

        other = ({"a/cpu0", "a/cpu1"} - {kept}).pop()  # another campaign takes the freed device on the node itself
        assert node_leases.acquire("someone-else/t@1", {other: 1}, {other: 1}, pid=os.getpid())
        refused = resize(2)
        said = " ".join((refused.stdout + refused.stderr).split())  # rich wraps lines
        assert refused.returncode != 0 and "a/cpu1 held by another campaign".replace("a/cpu1", other) in said, said
        assert running_on(1) and leased() == {kept, other}
        node_leases.release("someone-else/t@1")

        grown = resize(2)
        assert grown.returncode == 0, grown.stdout + grown.stderr
        wait_for(lambda: running_on(2), 60, "the grow")
        assert leased() == {"a/cpu0", "a/cpu1"}
        # A resize is recorded once the new generation has taken its first step: held again after it.
        trial_files(trial_dir).hold.unlink()
        events = wait_for(lambda: (lambda e: e if len(e) >= 2 else None)(
            [json.loads(line) for line in (trial_dir / "resizes.jsonl").read_text().splitlines()]), 60, "the grow's record")
        trial_files(trial_dir).hold.touch()
        assert [(len(e["from"]), len(e["to"])) for e in events] == [(2, 1), (1, 2)], events

        # Node b joins while the campaign runs; then node a dies: the trial resumes on b from its checkpoint.
        worker_b = start_worker(api, tmp_path, "b", *nodes["b"], 2, hide=hide)
        wait_for(lambda: "node b joined pool lab" in (tmp_path / "launch.log").read_text(), 120, "the campaign to see node b")
        if shared:
            wait_for(lambda: latest_valid_checkpoint(trial_files(trial_dir).checkpoints) is not None, 240, "the trial's checkpoint at step 500")
        else:
            at_remote = CheckpointRemote(str(tmp_path / "remote"), f"elastic/{trial_id}")
            wait_for(lambda: at_remote.entries(), 240, "the trial's checkpoint at step 500 on the remote")
            assert not trial_files(trial_dir).checkpoints.exists()
        kill_node("a")
        def on_b() -> list[str]:
            devices = (read_json(trial_dir / "control" / "state.json") or {}).get("devices", [])
            return devices if (running_on(1) or running_on(2)) and all(d.startswith("b/") for d in devices) else []

        moved = wait_for(on_b, 240, "the trial to resume on node b")  # at the size the policy starts it with
        assert {lease.device_id for lease in LeaseStore(tmp_path / "leases-b.db").leases()} == set(moved)
        moves = [e["reason"] for e in map(json.loads, (runs / "elastic" / "allocations.jsonl").read_text().splitlines())]
        assert moves[-2:] == ["node lost", "start"], moves
        def starts() -> list[tuple[str, str]]:  # (step, state from) of each start of the trial, once node b's has logged
            found = re.findall(r"generation 0 on \d device\(s\) \(.*\), step (\d+), state from (\w+)", (trial_dir / "train.log").read_text())
            return found if len(found) == 2 else []

        generations = wait_for(starts, 60, "the trial's start on node b in its log")
        assert generations[0] == ("0", "disk") and int(generations[1][0]) > 0 and int(generations[1][0]) % 500 == 0, generations

        launch.send_signal(signal.SIGTERM)  # the campaign stops: the trial with it, and its lease on the node
        assert launch.wait(timeout=120) == 143, (tmp_path / "launch.log").read_text()[-3000:]
        wait_for(lambda: not LeaseStore(tmp_path / "leases-b.db").leases(), 60, "node b's lease to go with the trial")
    finally:
        if launch is not None and launch.poll() is None:
            launch.kill()
        for proc in (worker, worker_b):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)


def trial_workers_of(node: str, with_state: bool = False) -> list:
    """The processes of a node that train (torchrun's workers; torchrun itself and its zygote
    hold no device), not counting those gone, zombies or being killed (conftest.running_state);
    with their state letters when `with_state`, for a failure's message."""
    found = []
    for pid in processes_of(node):
        try:
            if trainer_rank(pid) is None:
                continue
        except OSError:
            continue
        if (state := running_state(pid)) is not None:
            found.append((pid, state) if with_state else pid)
    return found


@pytest.mark.slow
@pytest.mark.waits
def test_a_stalled_holder_on_a_pool_node_never_shares_its_devices(tmp_path, digits_npz, lab):
    """The trial's holder on node a (its segment's flow-run process, which renews the node's
    lease) is stopped for twice the heartbeat timeout. Another campaign on the node's lease
    file tries for both devices every 0.1 s: it gets them only once the trial's workers have
    stopped themselves, and no worker of the trial runs while it holds them."""
    from cluster.leases import LeaseStore

    timeout_s = 6.0
    head, api, nodes = lab
    ns, address = nodes["a"]
    worker = start_live_worker(api, tmp_path, "a", ns, address, 2, CAMPAIGN_LEASE_TIMEOUT_S=str(timeout_s))
    launch = None
    devices = {"a/cpu0": 1, "a/cpu1": 1}
    try:
        params = tmp_path / "params.yaml"
        params.write_text(yaml.safe_dump({
            "campaign": {"name": "stalled", "seed": 3}, "data": {"path": str(digits_npz)}, "model": {"name": "mlp", "width": 8},
            "training": {"steps": 10**6, "batch_size": 32, "lr": 0.05, "checkpoint_every": 200},  # stopped by the test
            "resources": {"devices": 2},
            "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "stalled",
                         "runs_dir": str(tmp_path / "runs"), "summary": str(tmp_path / "summary.json")},
        }))
        launch = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "launch", str(params), "--pool", "lab", "--no-live"], cwd=tmp_path,
            env={**os.environ, "PREFECT_API_URL": api, "CAMPAIGN_LEASE_DB": str(tmp_path / "leases-head.db")},
            stdout=open(tmp_path / "launch.log", "wb"), stderr=subprocess.STDOUT)
        node_leases = LeaseStore(tmp_path / "leases-a.db", timeout_s)

        def training() -> bool:
            """Both workers train: a step done (DDP: both ranks past their fence's start). A
            worker still importing holds no device yet; its fence refuses it a lost lease."""
            if launch.poll() is not None:
                pytest.fail((tmp_path / "launch.log").read_text()[-3000:])
            stepped = any((read_json(path) or {}).get("step", 0) > 0 for path in (tmp_path / "runs").glob("stalled/*/progress.json"))
            return stepped and len(trial_workers_of("a")) == 2

        wait_for(training, 240, "the trial's two workers on node a, training")
        (holder_pid,) = {lease.pid for lease in node_leases.leases()}
        stall_outside_a_lease_transaction(holder_pid, tmp_path / "leases-a.db")
        stalled_at = time.monotonic()
        # Its last renewal, read once it can renew no more: the reclaim deadline runs from there
        # (the renewal before the stop may have come up to a heartbeat period late, under load).
        last_renewed = max(lease.heartbeat_at for lease in node_leases.leases())
        taken_wall = None
        taken_at = None
        overlaps, samples = [], 0

        def sample_while_held() -> None:
            """One sample while the taker holds the devices (it renews: its own heartbeat)."""
            nonlocal samples
            node_leases.renew("taker/t@1")
            samples += 1
            if running := trial_workers_of("a", with_state=True):
                overlaps.append((round(time.monotonic() - stalled_at, 2), running))

        try:
            while time.monotonic() - stalled_at < 2 * timeout_s or taken_at is None:
                assert time.monotonic() - stalled_at < 6 * timeout_s, "the devices were never freed"
                if taken_at is None and node_leases.acquire("taker/t@1", devices, devices, pid=os.getpid()):
                    taken_at, taken_wall = time.monotonic(), time.time()  # the store's clock is time.time
                if taken_at is not None:
                    sample_while_held()
                time.sleep(0.1)  # the sampling period (what is waited for is the loop's condition)
        finally:
            os.kill(holder_pid, signal.SIGCONT)
        # Not before the renew deadline and the store's margin, counted from the last renewal.
        assert taken_wall - last_renewed > timeout_s + node_leases.reclaim_margin_s, (taken_wall - last_renewed)
        # The holder wakes up to find its leases gone: the other campaign keeps the devices.
        for _ in range(30):
            sample_while_held()
            time.sleep(0.1)
        assert {lease.holder for lease in node_leases.leases()} == {"taker/t@1"}
        assert overlaps == [] and samples >= 40, overlaps[:5]
        log = next((tmp_path / "runs" / "stalled").glob("*/train.log")).read_text()
        assert "fenced:" in log, log[-3000:]  # the workers stopped themselves
        node_leases.release("taker/t@1")
    finally:
        end_launch_and_workers(launch, [worker])


@pytest.mark.slow
@pytest.mark.waits
@pytest.mark.parametrize("shared", [True, False], ids=["shared folder", "nothing shared"])
def test_an_elastic_trial_in_a_pool_is_grown_onto_a_second_node_by_the_policy_and_moved_by_hand(tmp_path, digits_npz, lab, shared):
    """An elastic [1, 2] trial on a pool of one-slot nodes starts on node a, the only one, under
    its agent. When node b joins, the policy grows it onto b; `campaign resize` to 1 takes it
    off b, and to 2 onto b again. Each node's lease file follows it, no step is lost, and its
    final weights equal those of the same trial run on one process, bit for bit.
    Every move is in memory, as on one node: the agent on a stays, a host segment on b (leased
    in b's file first) starts b's worker, which gets the state from rank 0; nothing stops, no
    checkpoint is written for a move. Node b killed outright, the agent goes on alone from its
    last checkpoint, and grows onto b again when b is back. Nothing shared: the agent's state
    reaches b's host through the campaign's copy (Prefect artifacts), and rank 0 writes each
    whole checkpoint on node a, so that a alone resumes from its own."""
    head, api, nodes = lab
    with campaign_folder(tmp_path, head, shared) as (folder, apart, hide):
        run_spread_campaign(tmp_path, digits_npz, api, nodes, folder, apart, hide)


def run_spread_campaign(tmp_path, digits_npz, api, nodes, folder, apart, hide) -> None:
    import torch

    from cluster.leases import LeaseStore
    from training.checkpoint import load_model_weights
    from training.config import TrialConfig
    from training.progress import read_progress
    from training.workload import build_model

    workers = {"a": start_live_worker(api, tmp_path, "a", *nodes["a"], 1, hide=hide)}
    launch = None
    runs = folder / "runs"
    try:
        params, trial_id, trial_dir = elastic_campaign(folder, digits_npz, "spread",
                                                       {"steps": 300, "checkpoint_every": 50, "eval_every": 300, "log_every": 10}, apart)
        trial_dir.mkdir(parents=True)
        trial_files(trial_dir).hold.touch()  # held from step HOLD_AT, at every control step after it, while the file is there
        launch = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "launch", str(params), "--pool", "lab", "--no-live"], cwd=folder,
            env={**os.environ, "PREFECT_API_URL": api, "CAMPAIGN_HOLD_AT_STEP": str(HOLD_AT),
                 "CAMPAIGN_LEASE_DB": str(tmp_path / "leases-head.db")},
            stdout=open(tmp_path / "launch.log", "wb"), stderr=subprocess.STDOUT)

        def leased() -> set[str]:
            return {lease.device_id for node in ("a", "b") for lease in LeaseStore(tmp_path / f"leases-{node}.db").leases()}

        def at_world(size: int) -> bool:
            if launch.poll() is not None:
                pytest.fail((tmp_path / "launch.log").read_text()[-3000:])
            progress = read_progress(trial_dir)
            return progress is not None and progress.world_size == size and progress.step >= HOLD_AT

        def resize(devices: int) -> str:
            done = subprocess.run([sys.executable, "-m", "flows.cli", "resize", trial_id, str(devices), "--runs-dir", str(runs),
                                   "--wait-s", "180"], capture_output=True, text=True, timeout=200, cwd=folder)
            said = " ".join((done.stdout + done.stderr).split())
            assert done.returncode == 0, said + (tmp_path / "launch.log").read_text()[-3000:]
            return said

        wait_for(lambda: at_world(1) and leased() == {"a/cpu0"}, 240, "the trial on node a, held")
        # Node b joins: the policy grows the trial onto it (nothing else waits; min_run_s does not hold back a grow).
        workers["b"] = start_live_worker(api, tmp_path, "b", *nodes["b"], 1, hide=hide)
        wait_for(lambda: at_world(2) and leased() == {"a/cpu0", "b/cpu0"}, 240, "the policy's grow across both nodes")
        resize(1)  # by hand; the size is pinned from now on
        wait_for(lambda: at_world(1) and len(leased()) == 1, 180, "the trial on one node")
        (first,) = leased()
        said = resize(2)
        assert "a/cpu0" in said and "b/cpu0" in said, said
        wait_for(lambda: at_world(2) and leased() == {"a/cpu0", "b/cpu0"}, 180, "the trial across both nodes again")
        # Node b dies outright: the agent on a goes on alone from its last checkpoint, and the
        # campaign follows it (its lease of b/cpu0 given back); b back, a grow is in memory again.
        head = LeaseStore(tmp_path / "leases-head.db")
        kill_node("b")
        workers["b"].wait(timeout=30)
        wait_for(lambda: at_world(1) and {lease.device_id for lease in head.leases()} == {"a/cpu0"}, 120,
                 "the trial on node a alone, the campaign following it")
        wait_for(lambda: "node b left the pool" in (tmp_path / "launch.log").read_text(), 120, "the campaign to drop node b")
        workers["b"] = start_live_worker(api, tmp_path, "b", *nodes["b"], 1, hide=hide)
        wait_for(lambda: "node b joined pool lab" in (tmp_path / "launch.log").read_text().split("node b left the pool")[-1], 120,
                 "the campaign to see node b back")
        said = resize(2)
        assert "a/cpu0" in said and "b/cpu0" in said, said
        wait_for(lambda: at_world(2) and leased() == {"a/cpu0", "b/cpu0"}, 180, "the trial across both nodes, b back")
        trial_files(trial_dir).hold.unlink()
        assert launch.wait(timeout=300) == 0, (tmp_path / "launch.log").read_text()[-3000:]
        assert not leased()

        log = (trial_dir / "train.log").read_text()
        stops = re.findall(r"stopped at step (\d+) for a resize \(checkpoint saved\)", log)
        moves = [(e["reason"], e["devices"]) for e in map(json.loads, (runs / "spread" / "allocations.jsonl").read_text().splitlines())]
        # In memory: one start, then every move by the agent on a (its host on b started b's worker), no stop.
        events = [json.loads(line) for line in (trial_dir / "resizes.jsonl").read_text().splitlines()]
        resizes = [(e["from"], e["to"], e["mode"]) for e in events]
        # The test holds each generation at its first step until its next command: that wait is
        # recorded apart (`held`), and the pause is what the move itself took, its parts' sum.
        assert any(e["pause_breakdown_s"].get("held", 0) > 0 for e in events), events
        for e in events:
            parts = sum(v for k, v in e["pause_breakdown_s"].items() if k != "held")
            assert e["pause_s"] > 0 and abs(parts - e["pause_s"]) < 1e-6, e
        both, grow, shrink = ["a/cpu0", "b/cpu0"], (["a/cpu0"], ["a/cpu0", "b/cpu0"], "resize"), (["a/cpu0", "b/cpu0"], ["a/cpu0"], "resize")
        # A resize is recorded at its generation's first step, which a held trial may not take
        # before the next move (it holds at a control step): the one b's loss cut short may lack its line.
        assert resizes in ([grow, shrink, grow, (*shrink[:2], "node lost"), grow], [grow, shrink, (*shrink[:2], "node lost"), grow]), resizes
        assert not stops and first == "a/cpu0", (stops, log[-3000:])
        assert moves == [("start", ["a/cpu0"]), ("resize", both), ("resize", ["a/cpu0"]), ("resize", both), ("resize", ["a/cpu0"]),
                         ("resize", both), ("end", [])], moves
        assert re.search(r"elastic host b: serving the agent at 10\.232\.\d+\.2:\d+", (trial_dir / "train-b.log").read_text())
        if apart is not None:  # b's workers ran in b's own folder of the trial, which holds no checkpoint (rank 0 writes it on a)
            on_b = tmp_path / "node-b" / "spread" / trial_id
            assert read_json(on_b / "trial-b.json")["trial_dir"] == str(on_b)
            assert not list((on_b / "checkpoints").glob("step-*")), sorted(p.name for p in on_b.rglob("*"))

        # The same trial on one process, from its own config: the same weights, bit for bit.
        config = trial_dir / "trial.json" if apart is None else tmp_path / "node-a" / "spread" / trial_id / "trial.json"
        raw = {**read_json(config), "trial_dir": str(tmp_path / "alone"), "hold_at_step": None, "lease": None,
               "mlflow_tracking_uri": None, "mlflow_run_id": None, "checkpoint_remote": None, "one_checkpoint_writer": False}
        alone = TrialConfig(**raw)
        Path(alone.trial_dir).mkdir()
        (Path(alone.trial_dir) / "trial.json").write_text(alone.to_json())
        done = subprocess.run([sys.executable, "-m", "training.launch", "--standalone", "--nproc-per-node=1", "-m", "training.train",
                               "--config", str(Path(alone.trial_dir) / "trial.json")],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

        def weights(directory: Path) -> dict:
            result = read_json(directory / "result.json")
            return load_model_weights(Path(result["checkpoint"]), build_model(alone.model)).state_dict()

        reference, moved = weights(Path(alone.trial_dir)), weights(trial_dir)
        assert reference.keys() == moved.keys()
        for name in reference:
            assert torch.equal(reference[name], moved[name]), name
    finally:
        for worker in workers.values():
            end_launch_and_workers(launch, [worker])
