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

pytestmark = pytest.mark.slow

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
    (Path(span.trial_dir) / "hold").write_text("")
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
        (Path(span.trial_dir) / "hold").unlink()
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
