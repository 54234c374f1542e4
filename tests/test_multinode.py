"""A trial across two nodes: two network namespaces on this machine, each a node with its own
address, joined by a veth pair; torchrun's c10d rendezvous on each (tasks.trial.plan_node_launch).

Needs root (`ip netns add`); skipped, saying so, where namespaces cannot be made.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cluster.types import Device
from tasks.trial import NodeRole, plan_node_launch
from training.config import TrialConfig
from training.layout import trial_files

pytestmark = pytest.mark.slow  # not `waits`: its trials compute most of their wall time (12 CPU-s in 21 s)

REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.231.{}.{}"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_nodes():
    """Namespaces a and b with 10.231.N.1 and .2 on a veth pair (and their own loopback)."""
    tag = os.getpid() % 250 + 1
    names = (f"campaign-a{os.getpid()}", f"campaign-b{os.getpid()}")
    links = (f"cva{os.getpid() % 100000}", f"cvb{os.getpid() % 100000}")
    try:
        ip("netns", "add", names[0])
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot make network namespaces here ({getattr(e, 'stderr', e)}): run as root with iproute2 to test several nodes")
    try:
        ip("netns", "add", names[1])
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        nodes = []
        for i, (ns, link) in enumerate(zip(names, links), start=1):
            address = SUBNET.format(tag, i)
            ip("link", "set", link, "netns", ns)
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", ns, "link", "set", link, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            nodes.append((ns, link, address))
        yield nodes
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def trial(trial_dir: Path, digits: Path) -> TrialConfig:
    return TrialConfig(trial_id="span", seed=5, model={"name": "mlp", "width": 16}, data={"path": str(digits)}, logical_ranks=2,
                       steps=40, batch_size=32, lr=0.05, checkpoint_every=20, eval_every=20, trial_dir=str(trial_dir))


def cpu_slot(node: str, core: int) -> Device:
    return Device(f"{node}/cpu{core}", node, core, "cpu", f"CPU core {core}", 1 << 30)


def listening(ns: str) -> set[str]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}


def final_weights(cfg: TrialConfig) -> dict[str, torch.Tensor]:
    import json

    from training.checkpoint import load_model_weights
    from training.workload import build_model

    result = json.loads(Path(cfg.result_path).read_text())
    return load_model_weights(Path(result["checkpoint"]), build_model(cfg.model)).state_dict()


def test_a_trial_across_two_nodes_trains_as_on_one_and_listens_only_on_their_addresses(tmp_path, digits_npz, two_nodes):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # The same trial on one node, 2 processes on loopback: the reference.
    one = trial(tmp_path / "one", digits_npz)
    Path(one.trial_dir).mkdir(parents=True)
    (Path(one.trial_dir) / "trial.json").write_text(one.to_json())
    done = subprocess.run([sys.executable, "-m", "training.launch", "--standalone", "--nproc-per-node=2", "-m", "training.train",
                           "--config", str(Path(one.trial_dir) / "trial.json")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # Across the two namespaces: one process on each, held at step 10 so their sockets can be read.
    span = trial(tmp_path / "span", digits_npz)
    span = dataclasses.replace(span, hold_at_step=10)
    Path(span.trial_dir).mkdir(parents=True)
    trial_files(span.trial_dir).hold.write_text("")
    (host_ns, host_link, host_addr), _ = two_nodes
    endpoint = f"{host_addr}:29531"
    procs = []
    for i, (ns, link, address) in enumerate(two_nodes):
        plan = plan_node_launch(span, [cpu_slot(ns, i)], REPO, NodeRole(2, i == 0, endpoint, address, link))
        if i == 0:
            plan.config_path.write_text(span.to_json())
        log = open(Path(span.trial_dir) / f"node{i}.log", "wb")
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *plan.command], cwd=plan.cwd, env={**env, **plan.env},
                                      stdout=log, stderr=subprocess.STDOUT))
    try:
        deadline = time.time() + 180
        while not (Path(span.trial_dir) / "progress.json").exists() or '"step": 10' not in (Path(span.trial_dir) / "progress.json").read_text():
            assert time.time() < deadline and all(p.poll() is None for p in procs), [
                (Path(span.trial_dir) / f"node{i}.log").read_text()[-2000:] for i in range(2)]
            time.sleep(0.5)
        for ns, _, address in two_nodes:  # the store, the workers' transport: the node's own address, or its loopback
            assert listening(ns) <= {address, "127.0.0.1"}, (ns, listening(ns))
        assert listening(host_ns) & {host_addr}  # the rendezvous store is on the host node's address
        trial_files(span.trial_dir).hold.unlink()
        for i, proc in enumerate(procs):
            assert proc.wait(timeout=300) == 0, (Path(span.trial_dir) / f"node{i}.log").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    # Two logical ranks, one per node or both on one: the same trial, bit for bit.
    reference, spanned = final_weights(one), final_weights(span)
    assert reference.keys() == spanned.keys()
    for name in reference:
        assert torch.equal(reference[name], spanned[name]), name


def progress_step(cfg: TrialConfig) -> int:
    from training.progress import read_progress

    progress = read_progress(cfg.trial_dir)
    return -1 if progress is None else progress.step


def test_an_elastic_trial_across_nodes_goes_on_without_a_lost_node_and_takes_it_back(tmp_path, digits_npz, two_nodes):
    """`--nnodes=1:2`: node b killed outright mid-training, node a goes on alone from the last
    checkpoint (at most one interval lost); b started again, both restart together; the
    result is the one-node run's, bit for bit (two logical ranks throughout)."""
    import re
    import signal

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    settings = dict(steps=1200, checkpoint_every=100, eval_every=600, model={"name": "mlp", "width": 64}, batch_size=64)
    one = dataclasses.replace(trial(tmp_path / "one", digits_npz), **settings)
    Path(one.trial_dir).mkdir(parents=True)
    (Path(one.trial_dir) / "trial.json").write_text(one.to_json())
    done = subprocess.run([sys.executable, "-m", "training.launch", "--standalone", "--nproc-per-node=2", "-m", "training.train",
                           "--config", str(Path(one.trial_dir) / "trial.json")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # Held at step 1000 (while `hold` exists): node b's return is taken in before the end.
    span = dataclasses.replace(trial(tmp_path / "span", digits_npz), **settings, hold_at_step=1000)
    Path(span.trial_dir).mkdir(parents=True)
    trial_files(span.trial_dir).hold.write_text("")
    (_, _, host_addr), _ = two_nodes
    endpoint = f"{host_addr}:29532"
    logs = [Path(span.trial_dir) / "node-a.log", Path(span.trial_dir) / "node-b.log"]

    def launch(i: int) -> subprocess.Popen:
        ns, link, address = two_nodes[i]
        plan = plan_node_launch(span, [cpu_slot(ns, i)], REPO, NodeRole(2, i == 0, endpoint, address, link, min_nodes=1))
        if i == 0:
            plan.config_path.write_text(span.to_json())
        with open(logs[i], "ab") as log:
            return subprocess.Popen(["ip", "netns", "exec", ns, *plan.command], cwd=plan.cwd, env={**env, **plan.env},
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(what: str, check, procs, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while not check():
            assert time.time() < deadline and all(p.poll() is None for p in procs), (what, [log.read_text()[-2500:] for log in logs])
            time.sleep(0.2)

    def resumed_at(world: int) -> list[int]:
        return [int(s) for s in re.findall(rf"world size {world}, resumed at step (\d+)", logs[0].read_text())]

    def world_sizes() -> list[int]:
        return [int(s) for s in re.findall(r"world size (\d+)", logs[0].read_text())]

    host, node_b = launch(0), launch(1)
    procs = [host, node_b]
    try:
        # Under load node a may start alone (node b later than the rendezvous' last call) and
        # take node b in by a restart: wait for both, whichever way they came together.
        wait("both nodes training", lambda: world_sizes()[-1:] == [2] and progress_step(span) >= 300, procs)
        lost_at = progress_step(span)
        os.killpg(node_b.pid, signal.SIGKILL)  # the node's agent and worker, as a machine lost
        node_b.wait()
        wait("node a alone", lambda: world_sizes()[-1] == 1, [host])
        assert lost_at - resumed_at(1)[-1] <= span.checkpoint_every + 10, (lost_at, resumed_at(1))  # one interval (+ a log step)
        wait("node a at the hold", lambda: progress_step(span) == 1000, [host])
        before = len(resumed_at(2))
        node_b = launch(1)  # the node is back
        procs = [host, node_b]
        wait("both nodes again", lambda: len(resumed_at(2)) > before, procs)
        for ns, _, address in two_nodes:  # stores made by the workers themselves too (no shared agent store)
            assert listening(ns) <= {address, "127.0.0.1"}, (ns, listening(ns))
        trial_files(span.trial_dir).hold.unlink()
        for i, proc in enumerate(procs):
            assert proc.wait(timeout=300) == 0, logs[i].read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert resumed_at(2)[-1] >= 900  # taken back at the hold, from the checkpoint before it
    reference, spanned = final_weights(one), final_weights(span)
    for name in reference:
        assert torch.equal(reference[name], spanned[name]), name


def node_slot(ns: str, core: int) -> dict:
    return {"id": f"{ns}/cpu{core}", "node": ns, "env": {"CAMPAIGN_CPU_CORES": str(core % os.cpu_count()), "CUDA_VISIBLE_DEVICES": ""}}


def test_an_elastic_trial_grows_onto_another_node_and_off_it_in_memory(tmp_path, digits_npz, two_nodes):
    """Our agent across nodes: the agent on node a, a host on node b (training.elastic_host).
    1 device on a -> one on a and one on b -> back to a's: each resize in memory (b's joiner
    gets the state from rank 0 on a; no checkpoint written for either), the stop signals
    through the agent's store; the samples of every step and the final weights are a fixed
    one-device run's, bit for bit (two logical ranks). The agent's store listens on a's
    address only. Then node b is lost outright at 2 devices, and comes back (below)."""
    import signal

    from elastic_helpers import (final_weights as weights_of, finish, hold, release_when_asked_to_stop, resize, resizes, run, start,
                                 step_of, stop_requests, trace, trial_config, wait_for_step)

    (ns_a, link_a, addr_a), (ns_b, link_b, addr_b) = two_nodes
    store = f"{addr_a}:29541"
    base = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    on_a = dict(prefix=("ip", "netns", "exec", ns_a), env={**base, "CAMPAIGN_BIND_ADDR": addr_a, "GLOO_SOCKET_IFNAME": link_a},
                agent_args=("--node", ns_a, "--store-port", store.rsplit(":", 1)[1]))

    def slots(n: int) -> list[dict]:
        return [node_slot(ns_a, 0), node_slot(ns_b, 1)][:n]

    def host(log: Path) -> subprocess.Popen:
        with open(log, "ab") as out:
            return subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-m", "training.elastic_host", "--store", store,
                                     "--node", ns_b], env={**base, "CAMPAIGN_BIND_ADDR": addr_b, "GLOO_SOCKET_IFNAME": link_b},
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    fixed = trial_config(tmp_path / "fixed", digits_npz, steps=400)
    finish(run(fixed, 1), fixed)
    spanned = trial_config(tmp_path / "spanned", digits_npz, steps=400, hold_at_step=100)
    Path(spanned.trial_dir).mkdir(parents=True)
    node_b = host(tmp_path / "host.log")

    def resize_when_held(cfg: TrialConfig, agent: subprocess.Popen, seq: int, devices: int) -> None:
        """Held at a control step (the hold file), the trial is resized, and let go once its
        agent asks it to stop: neither a joiner's start nor the host's load costs it steps,
        nor can it end before the resize."""
        before = stop_requests(cfg)
        resize(cfg, seq, devices, slots=slots)
        release_when_asked_to_stop(cfg, agent, before)
        wait_for_resizes(cfg, agent, seq)

    def wait_for_resizes(cfg: TrialConfig, agent: subprocess.Popen, count: int) -> None:
        deadline = time.time() + 120
        while len(resizes(cfg)) < count:
            assert agent.poll() is None and time.time() < deadline, (Path(cfg.trial_dir) / "agent.log").read_text()[-3000:]
            time.sleep(0.01)

    def end(held: Path, *procs: subprocess.Popen) -> None:
        held.unlink(missing_ok=True)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    held = hold(spanned)
    agent = start(spanned, 1, slots, **on_a)
    try:
        wait_for_step(spanned, 100, agent, timeout=180)
        resize_when_held(spanned, agent, 1, 2)  # held at step 100
        assert listening(ns_a) <= {addr_a, "127.0.0.1"}, listening(ns_a)  # its store: a's address, not every interface
        hold(spanned)  # held again at its next control step
        resize_when_held(spanned, agent, 2, 1)
        finish(agent, spanned)
    finally:
        end(held, agent, node_b)
    log = (Path(spanned.trial_dir) / "agent.log").read_text()
    events = resizes(spanned)
    assert [(e["from"], e["to"], e["mode"]) for e in events] == [
        ([f"{ns_a}/cpu0"], [f"{ns_a}/cpu0", f"{ns_b}/cpu1"], "resize"), ([f"{ns_a}/cpu0", f"{ns_b}/cpu1"], [f"{ns_a}/cpu0"], "resize")]
    assert "generation 1 on 2 device(s)" in log and log.count("state from memory") == 2, log[-3000:]
    assert "checkpoint saved" not in log  # neither resize went through the disk
    ta, tb = trace(fixed), trace(spanned)
    assert sorted(ta) == sorted(tb) == list(range(400)) and all(ta[s][0] == tb[s][0] for s in ta)
    reference, result = weights_of(fixed), weights_of(spanned)
    for name in reference:
        assert torch.equal(reference[name], result[name]), name

    # Node b lost at 2 devices, its host and worker killed outright: the agent goes on alone from
    # the last checkpoint (at most one interval trained again), and grows back onto b in memory
    # once a new host beats there; the result is still the fixed run's, bit for bit.
    lost = trial_config(tmp_path / "lost", digits_npz, steps=400, checkpoint_every=50, hold_at_step=300)
    held = hold(lost)
    node_b = host(tmp_path / "host-lost.log")
    agent = start(lost, 2, slots, **on_a)
    try:
        wait_for_step(lost, 150, agent, timeout=180)
        os.killpg(node_b.pid, signal.SIGKILL)
        killed_at = step_of(lost)
        wait_for_resizes(lost, agent, 1)  # the node's loss
        wait_for_step(lost, 300, agent)  # held there until b is back
        node_b = host(tmp_path / "host-back.log")
        resize_when_held(lost, agent, 1, 2)
        finish(agent, lost)
    finally:
        end(held, agent, node_b)
    log = (Path(lost.trial_dir) / "agent.log").read_text()
    gone, back = resizes(lost)
    assert (gone["mode"], gone["to"], back["mode"], back["to"]) == ("node lost", [f"{ns_a}/cpu0"], "resize", [f"{ns_a}/cpu0", f"{ns_b}/cpu1"]), log[-3000:]
    resumed = int(log.split("generation 1 on 1 device(s)")[1].split("step ")[1].split(",")[0])
    assert killed_at - resumed <= lost.checkpoint_every + lost.log_every, (killed_at, resumed)
    assert f"{ns_b} lost: the trial goes on from its last checkpoint" in log, log[-3000:]
    tl = trace(lost)
    assert sorted(tl) == list(range(400)) and all(ta[s][0] == tl[s][0] for s in ta)
    result = weights_of(lost)
    for name in reference:
        assert torch.equal(reference[name], result[name]), name
