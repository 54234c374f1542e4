"""A trial on node a grows onto node b (issue 30): how long does training stop, three ways.

- elastic: node a runs torchrun with `--nnodes=1:2` (tasks/trial.py `plan_node_launch`,
  `min_nodes=1`); node b starts the same command; a's agent sees it waiting and both restart
  their workers from the trial's last checkpoint, at world size 2.
- stop and relaunch from the remote: node a's fixed-size torchrun is stopped (SIGTERM), and
  both nodes start a 2-node torchrun, resuming from the newest checkpoint pulled from a DVC
  directory remote (the trial's local checkpoints moved aside first: a placement on nodes
  that do not share the trial's folder).
- our agent across nodes, in memory (training/elastic.py with `--node`, training/elastic_host.py):
  node a runs the trial's agent, its store on a's address; at the decision node b starts a
  host, the agent asks it for a worker there, which loads everything while the trial trains
  on, then joins at a control step and gets the state from rank 0 in memory.
- stop file and relaunch (what a pool campaign does when a resize moves an elastic trial,
  flows/run/live.py `Running.relaunch`): node a's torchrun is asked to stop through its stop file
  (`TrialConfig.stop_path`, training/train.py `StopFile`), every rank stops at the next
  control step at a checkpoint it writes then, and both nodes start a 2-node torchrun from it.

Both ways push every checkpoint to the same kind of remote (`checkpoint_remote`), and
alternate round by round so they see the host's load of the same moment. Per way, medians:
- latency: node b started (elastic) or node a stopped (relaunch) -> the first step at world
  size 2;
- pause: the last step at world size 1 -> the first at world size 2 (nothing trains);
- steps lost: steps done at world size 1 after the checkpoint the resume used.

Nodes are two network namespaces joined by a veth pair (as tests/test_multinode.py): needs
root and iproute2.

    .venv/bin/python bench/cross_node_resize.py --rounds 3      # as root

Prints a table; passes nothing. For our agent, the pause its trainer records (resizes.jsonl:
from the last step at 1 device to the first at 2, to the ms) is printed beside the pause
seen in the progress file, which is the same for every way and as coarse as its writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from cluster.types import Device  # noqa: E402
from tasks.trial import NodeRole, plan_node_launch  # noqa: E402
from training.config import TrialConfig  # noqa: E402
from training.agent_commands import write_command  # noqa: E402
from training.data import prepare_digits  # noqa: E402
from training.progress import read_progress  # noqa: E402


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class TwoNodes:
    """Namespaces a and b, 10.234.N.1 and .2 on a veth pair."""

    def __init__(self):
        pid = os.getpid()
        self.names = (f"bench-a{pid}", f"bench-b{pid}")
        links = (f"bxa{pid % 100000}", f"bxb{pid % 100000}")
        ip("netns", "add", self.names[0])
        ip("netns", "add", self.names[1])
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        self.nodes = []
        for i, (ns, link) in enumerate(zip(self.names, links), start=1):
            address = f"10.234.{pid % 250 + 1}.{i}"
            ip("link", "set", link, "netns", ns)
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", ns, "link", "set", link, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            self.nodes.append((ns, link, address))

    def close(self) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Trial:
    """One trial's folder, its node launches, and what its progress file said when."""

    def __init__(self, folder: Path, digits: Path, nodes: list, elastic: bool, port: int, steps: int, every: int, stop: bool = False):
        self.folder, self.nodes, self.elastic = folder, nodes, elastic
        self.cfg = TrialConfig(trial_id="grow", seed=7, model={"name": "mlp", "width": 256}, data={"path": str(digits)},
                               logical_ranks=2, steps=steps, batch_size=128, lr=0.05, checkpoint_every=every,
                               eval_every=steps, log_every=10, trial_dir=str(folder / "trial"),
                               checkpoint_remote={"url": str(folder / "remote"), "key": "bench/grow"},
                               stop_path=str(folder / "stop-1") if stop else None)
        Path(self.cfg.trial_dir).mkdir(parents=True)
        (folder / "remote").mkdir()
        self.endpoint = f"{nodes[0][2]}:{port}"
        self.procs: list[subprocess.Popen] = []
        self.seen: list[tuple[float, int, int]] = []  # (time, step, world size)

    def launch(self, i: int, nnodes: int) -> None:
        ns, link, address = self.nodes[i]
        role = NodeRole(nnodes, i == 0, self.endpoint, address, link, min_nodes=1 if self.elastic else None)
        plan = plan_node_launch(self.cfg, [Device(f"{ns}/cpu{i}", ns, i, "cpu", f"core {i}", 1 << 30)], REPO, role)
        plan.config_path.write_text(self.cfg.to_json())
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **plan.env}
        with open(self.folder / f"node{i}.log", "ab") as log:
            self.procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *plan.command], cwd=REPO, env=env, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))

    def launch_agent(self, port: int) -> None:
        """Our agent on node a, on 1 device (command 0), its store on a's address at `port`."""
        ns, link, address = self.nodes[0]
        control = Path(self.cfg.trial_dir) / "control"
        control.mkdir()
        config = Path(self.cfg.trial_dir) / "trial.json"
        config.write_text(self.cfg.to_json())
        write_command(control, 0, [self.agent_slot(0)])
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CAMPAIGN_BIND_ADDR": address, "GLOO_SOCKET_IFNAME": link}
        with open(self.folder / "node0.log", "ab") as log:
            self.procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "training.elastic", "--config", str(config),
                                                "--control", str(control), "--node", ns, "--store-port", str(port)],
                                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def agent_slot(self, i: int) -> dict:
        ns = self.nodes[i][0]
        return {"id": f"{ns}/cpu{i}", "node": ns, "env": {"CAMPAIGN_CPU_CORES": str(i % os.cpu_count()), "CUDA_VISIBLE_DEVICES": ""}}

    def grow_agent(self, port: int) -> None:
        """Node b's host, and the agent's command to grow onto b's device."""
        ns, link, address = self.nodes[1]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CAMPAIGN_BIND_ADDR": address, "GLOO_SOCKET_IFNAME": link}
        with open(self.folder / "node1.log", "ab") as log:
            self.procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "training.elastic_host",
                                                "--store", f"{self.nodes[0][2]}:{port}", "--node", ns],
                                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        write_command(Path(self.cfg.trial_dir) / "control", 1, [self.agent_slot(0), self.agent_slot(1)])

    def agent_resize(self) -> dict:
        """The agent's resize as its trainer recorded it (resizes.jsonl), and the steps it lost."""
        import json

        path = Path(self.cfg.trial_dir) / "resizes.jsonl"
        while not path.exists() or not path.read_text().strip():
            time.sleep(0.01)
        event = json.loads(path.read_text().splitlines()[0])
        log = (self.folder / "node0.log").read_text(errors="replace")
        stopped = int(log.split("stopped at step ")[1].split()[0])
        started = int(log.split("generation 1 on 2 device(s)")[1].split("step ")[1].split(",")[0])
        return {"recorded_pause_s": event["pause_s"], "steps_lost": stopped - started, "from": event["pause_breakdown_s"]}

    def look(self) -> tuple[int, int]:
        """The progress file now: (step, world size), recorded with the time it was seen."""
        progress = read_progress(self.cfg.trial_dir)
        if progress is None:
            return -1, 0
        step, world = progress.step, progress.world_size
        if not self.seen or self.seen[-1][1:] != (step, world):
            self.seen.append((time.time(), step, world))
        return step, world

    def wait(self, check, timeout: float = 300.0) -> None:
        deadline = time.time() + timeout
        while not check(*self.look()):
            if time.time() > deadline or any(p.poll() not in (None, 0) for p in self.procs):
                logs = [(self.folder / f"node{i}.log").read_text(errors="replace")[-2000:] for i in range(2)
                        if (self.folder / f"node{i}.log").exists()]
                raise RuntimeError("timed out or a node failed; logs:\n" + "\n---\n".join(logs))
            time.sleep(0.01)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = [p for p in self.procs if p.poll() is None]

    def resumed_from(self) -> int:
        if (Path(self.cfg.trial_dir) / "control").exists():  # our agent: no resume, a resize
            return -1
        text = "".join((self.folder / f"node{i}.log").read_text(errors="replace") for i in range(2)
                       if (self.folder / f"node{i}.log").exists())
        return max(int(line.split("resumed at step ")[1].split()[0]) for line in text.splitlines() if "world size 2, resumed at step" in line)


def one_round(way: str, folder: Path, digits: Path, nodes: list, port: int, grow_at: int, every: int) -> dict[str, float]:
    trial = Trial(folder, digits, nodes, elastic=way == "elastic", port=port, steps=100 * grow_at, every=every, stop=way == "stop file")
    try:
        if way == "agent":
            trial.launch_agent(port)
        else:
            trial.launch(0, 2 if way == "elastic" else 1)
        trial.wait(lambda step, world: step >= grow_at and world == 1)
        decided = time.time()
        at_decision = trial.look()[0]
        if way == "agent":
            trial.grow_agent(port)
        elif way == "elastic":
            trial.launch(1, 2)
        elif way == "stop file":
            Path(trial.cfg.stop_path).touch()
            for proc in trial.procs:
                assert proc.wait(timeout=120) == 0, (folder / "node0.log").read_text()[-2000:]
            trial.procs = []
            trial.cfg = dataclasses.replace(trial.cfg, stop_path=str(folder / "stop-2"))
            trial.endpoint = f"{nodes[0][2]}:{port + 1000}"  # a fresh rendezvous, as a relaunch's new attempt has
            trial.launch(0, 2)
            trial.launch(1, 2)
        else:
            trial.stop()
            checkpoints = Path(trial.cfg.trial_dir) / "checkpoints"
            shutil.move(checkpoints, folder / "checkpoints-aside")  # resumed from the remote, not this folder
            trial.launch(0, 2)
            trial.launch(1, 2)
        trial.wait(lambda step, world: world == 2 and step > 0 and any(w == 1 for _, _, w in trial.seen))
        first_two = next(t for t, _, w in trial.seen if w == 2 and t >= decided)
        last_one = max(t for t, _, w in trial.seen if w == 1)
        figures = {"latency_s": first_two - decided, "pause_s": first_two - last_one, "step_at_decision": at_decision}
        if way == "agent":
            recorded = trial.agent_resize()
            return figures | {"steps_lost": recorded["steps_lost"], "recorded_pause_s": recorded["recorded_pause_s"]}
        last_step_at_one = max(s for _, s, w in trial.seen if w == 1)
        return figures | {"steps_lost": max(0, last_step_at_one - trial.resumed_from())}
    finally:
        trial.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grow-at", type=int, default=300, help="the step at world size 1 where node b is added")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--ways", default="agent,elastic,relaunch,stop file", help="which ways, comma-separated")
    args = parser.parse_args()
    console = Console(width=160)
    console.print(f"[bold]command:[/bold] {' '.join(sys.argv)}")
    console.print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores")
    try:
        nodes = TwoNodes()
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"cannot make network namespaces here ({getattr(e, 'stderr', e)}): run as root with iproute2")
    work = Path(tempfile.mkdtemp(prefix="cross-node-resize-"))
    ways = tuple(way.strip() for way in args.ways.split(","))
    results: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    try:
        digits = prepare_digits(work / "digits.npz")
        port = 29600
        for r in range(args.rounds):
            for way in ways[r % len(ways):] + ways[:r % len(ways)]:  # each way first in turn
                port += 1
                figures = one_round(way, work / f"{way.replace(' ', '-')}-{r}", digits, nodes.nodes, port, args.grow_at, args.checkpoint_every)
                results[way].append(figures)
                console.print(f"round {r + 1} {way}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
    finally:
        nodes.close()
        shutil.rmtree(work, ignore_errors=True)
    # The decision comes at the first progress write past --grow-at (its column: how far past).
    table = Table(title=f"1 node -> 2 nodes once past step {args.grow_at}, checkpoint every {args.checkpoint_every} steps "
                        f"(medians of {args.rounds} rounds)")
    for column in ("way", "step at decision", "latency s", "pause s", "steps lost", "recorded pause s"):
        table.add_column(column, justify="right" if column != "way" else "left")
    labels = (("agent", "our agent across nodes (in memory)"), ("elastic", "torchrun elastic (--nnodes=1:2, node b joins)"),
                       ("relaunch", "stop + relaunch from the DVC remote"), ("stop file", "stop at a checkpoint + relaunch (a pool's move)"))
    for way, label in ((way, label) for way, label in labels if way in ways):
        rows = results[way]
        table.add_row(label, *(f"{statistics.median(r[key] for r in rows):.2f}" if key in rows[0] else "-"
                               for key in ("step_at_decision", "latency_s", "pause_s", "steps_lost", "recorded_pause_s")))
    console.print(table)


if __name__ == "__main__":
    main()
