"""A node's share of an elastic trial that spans nodes: it starts the agent's workers here.

    python -m training.elastic_host --store ADDR:PORT --node NAME

An elastic trial's agent (training.elastic) runs on one node and holds the trial's store. On
every other node the trial may grow onto, a host connects to that store and does there what
the agent does on its own node: it forks the workers the agent asks for (from a zygote of
training.elastic_worker, as the agent does), tells the agent when one exits and with what
code, and kills one when told. Its workers join the agent's store and each generation's
process group over the network and from there train as the agent's own do: a joiner gets
the trial's state from rank 0 in memory while the others keep theirs, so growing onto a node
or shrinking off it pauses training as briefly as a resize on one node, where a torchrun
trial across nodes restarts every process from a checkpoint (bench/cross_node_resize.py).

Protocol: keys in the agent's store. A host that starts takes the node's next incarnation
(`host/<node>/incarnation`, added to), so that a node that comes back after it was lost
starts afresh; the rest are under `host/<node>/<incarnation>/` (host_key):
    beat          added to every BEAT_S by the host (a thread); a node whose beat stops for LOST_S is lost
    spawn/<k>     {"wid", "env", "config", "config_text", "hmac"}: the k-th worker to start (k from 0)
    kill/<wid>    set by the agent: kill that worker
    exit/<wid>    set by the host: that worker's exit code (and why/<wid>, for one it refused)
The store has no authentication (as torchrun's): it listens on the agent node's address,
only while the trial runs, and anyone who reaches it could disturb the trial. What it could
not do is run code here: a worker runs the config it is sent, and a config names code to
import (`model.target`), so each spawn request carries an HMAC-SHA256 by the checkpoint key
(training/manifest.py `signing_key`, which the nodes of a trial across nodes share to verify
each other's checkpoints) over the request and the key it was written under, and a host
refuses one that does not verify: nothing starts, the worker's exit is 2 and `why/<wid>`
says why. The host ends when the agent's store goes (the agent exited), and kills what is
left of its workers first; its workers die with it.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from training.layout import of_node

BEAT_S = 0.5
LOST_S = 5.0  # no beat for this long: the node is taken as lost (its workers as killed)
POLL_S = 0.01


def incarnation_key(node: str) -> str:
    return f"host/{node}/incarnation"


def host_key(node: str, incarnation: int, *parts: str) -> str:
    return "/".join(("host", node, str(incarnation), *parts))


def sign_request(store_key: str, request: dict) -> dict:
    """The spawn request with its signature, bound to the store key it is written under."""
    return {**request, "hmac": _signature(store_key, request)}


def request_problem(store_key: str, signed: dict) -> str | None:
    """Why a spawn request must not run (None: it is the agent's, unchanged)."""
    if not isinstance(signed, dict) or not isinstance(signed.get("hmac"), str):
        return "unsigned"
    body = {k: v for k, v in signed.items() if k != "hmac"}
    if set(body) != {"wid", "env", "config", "config_text"}:
        return f"unexpected fields {sorted(body)}"
    if not hmac.compare_digest(signed["hmac"], _signature(store_key, body)):
        return "its signature does not verify with this node's checkpoint key ($CAMPAIGN_CHECKPOINT_KEY: the agent's node's key)"
    return None


def _signature(store_key: str, request: dict) -> str:
    from training.manifest import signing_key

    canonical = json.dumps({"key": store_key, "request": request}, sort_keys=True).encode()
    return hmac.new(signing_key(), canonical, hashlib.sha256).hexdigest()


def stop_key(path: Path) -> str:
    """The store key that stands for one of the agent's stop files (`stop-<gen>`, `stop-<gen>.at`),
    for a generation across nodes, whose other nodes do not see the agent's files."""
    return f"control/{Path(path).name}"


class Host:
    def __init__(self, store, node: str, python: str = sys.executable, lease: dict | None = None, trial_dir: Path | None = None):
        """`lease`: this node's own lease of its devices (a pool's node lease file), which its
        workers watch instead of the agent's node's (training.fence). `trial_dir`: this node's
        folder of the trial (its own when the nodes share none), which its workers' config names."""
        self.store, self.node, self.python, self.lease, self.trial_dir = store, node, python, lease, trial_dir
        self.zygote = None  # started by run(), before the agent asks for anything
        self.workers: dict[str, object] = {}  # wid -> Popen or ForkedProcess
        self.reported: set[str] = set()
        self.next_spawn = 0
        self.incarnation = store.add(incarnation_key(node), 1)

    def key(self, *parts: str) -> str:
        return host_key(self.node, self.incarnation, *parts)

    def spawn(self, request: dict) -> None:
        from training.elastic import worker_env, worker_name  # not at the top: training.elastic imports this module
        from training.zygote import ZygoteGone

        config, text = Path(request["config"]), request["config_text"]
        if self.lease is not None or self.trial_dir is not None:
            # Its workers watch this node's lease, in this node's folder: a config of the node's own.
            changes = ({"lease": self.lease} if self.lease is not None else {}) | \
                      ({"trial_dir": str(self.trial_dir)} if self.trial_dir is not None else {})
            config = of_node((self.trial_dir or config.parent) / config.name, self.node)
            text = json.dumps({**json.loads(text), **changes}, indent=2, sort_keys=True)
        if not config.exists() or config.read_text() != text:  # nothing shared with the agent's node:
            config.parent.mkdir(parents=True, exist_ok=True)  # the trial's config travels with the request (signed)
            config.write_text(text)
        # Rank 0 is on the agent's node, never here: with one checkpoint writer, this node's
        # workers drop the empty folders each save leaves here (training.checkpoint).
        env = {**worker_env(request["env"], request["wid"], self.store.host, self.store.port), "GROUP_RANK": "1"}
        args = ["--config", str(config)]
        try:
            proc = self.start_zygote().fork("training.elastic_worker", args, env, Path.cwd(), name=worker_name(request["wid"]))
        except ZygoteGone:
            proc = subprocess.Popen([self.python, "-m", "training.elastic_worker", *args], env=env)
        self.workers[request["wid"]] = proc

    def start_zygote(self):
        """The zygote the workers are forked from, started with the host: its import of torch
        and the trainer is done before the agent asks for a worker, not while the trial waits."""
        from training.elastic import WORKER_ENV
        from training.zygote import Zygote

        if self.zygote is None:
            self.zygote = Zygote(["training.elastic_worker"], Path.cwd(), {**os.environ, **WORKER_ENV}, self.python,
                                 output=None, serves=f"elastic host {self.node}")
        return self.zygote

    def refuse(self, key: str, request, problem: str) -> None:
        """Nothing of the request runs; the agent sees its worker exit with 2, and why."""
        wid = request.get("wid") if isinstance(request, dict) and isinstance(request.get("wid"), str) else None
        print(f"elastic host {self.node}: refused {key}: {problem}", flush=True)
        if wid is not None and wid not in self.workers:
            self.store.set(self.key("why", wid), f"node {self.node} refused to start it: {problem}")
            self.store.set(self.key("exit", wid), "2")
            self.reported.add(wid)

    def step(self) -> None:
        """One pass: start what was asked, kill what was told, report what exited."""
        while self.store.check([key := self.key("spawn", str(self.next_spawn))]):
            self.next_spawn += 1
            try:
                request = json.loads(self.store.get(key))
            except ValueError:
                request = None
            if (problem := request_problem(key, request)) is not None:
                self.refuse(key, request, problem)
                continue
            self.spawn(request)
        for wid, proc in self.workers.items():
            if wid in self.reported:
                continue
            code = proc.poll()
            if code is None and self.store.check([self.key("kill", wid)]):
                proc.kill()
            elif code is not None:
                self.store.set(self.key("exit", wid), str(code))
                self.reported.add(wid)

    def beat(self, store, stop: threading.Event) -> None:
        """Beat through a connection of its own, on a thread: the loop above waits seconds in a
        fork while the zygote is still importing, and a node must not look lost meanwhile."""
        while True:
            try:
                store.add(self.key("beat"), 1)
            except RuntimeError:  # the store is gone: the loop above sees it too
                return
            if stop.wait(BEAT_S):
                return

    def run(self, beat_store, ready: Path | None = None) -> int:
        """Serve the agent until its store goes. `ready`: a file written once this host beats
        under its incarnation (what a pool's segment waits for before the agent is told)."""
        stop = threading.Event()
        threading.Thread(target=self.beat, args=(beat_store, stop), name="beat", daemon=True).start()
        self.start_zygote()
        if ready is not None:
            tmp = ready.with_name(ready.name + ".tmp")
            tmp.write_text(json.dumps({"incarnation": self.incarnation, "time": time.time()}))
            tmp.replace(ready)
        try:
            while True:
                self.step()
                time.sleep(POLL_S)
        except RuntimeError as e:  # the store is gone: the agent exited (torch's DistNetworkError, DistStoreError)
            print(f"elastic host {self.node}: the agent's store is gone ({type(e).__name__}); ending", flush=True)
            return 0
        finally:
            stop.set()
            self.close()

    def kill_all(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()

    def close(self) -> None:
        self.kill_all()
        for proc in self.workers.values():
            proc.wait()
        if self.zygote is not None:
            self.zygote.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start an elastic trial's workers on this node for its agent on another.")
    parser.add_argument("--store", required=True, help="the agent's store, ADDR:PORT (its --store-port on its node's address)")
    parser.add_argument("--node", required=True, help="this node's name, as the agent's commands name its devices' node")
    parser.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the agent's store to answer")
    parser.add_argument("--ready", type=Path, help="a file to write once this host serves the agent")
    parser.add_argument("--lease", type=json.loads, help="this node's lease of its devices (JSON, cluster.leases fence): its workers watch it")
    parser.add_argument("--trial-dir", type=Path, help="this node's folder of the trial (its own when the nodes share none)")
    args = parser.parse_args(argv)
    from training.process import die_with_parent, skip_final_collection

    die_with_parent(signal.SIGTERM)
    skip_final_collection()
    import torch.distributed as dist

    address, _, port = args.store.rpartition(":")
    store, beat_store = (dist.TCPStore(address, int(port), is_master=False, timeout=timedelta(seconds=args.wait)) for _ in range(2))
    host = Host(store, args.node, lease=args.lease, trial_dir=args.trial_dir)
    signal.signal(signal.SIGTERM, lambda *_: (host.kill_all(), os._exit(1)))  # its zygote ends with it
    print(f"elastic host {args.node}: serving the agent at {args.store}", flush=True)
    return host.run(beat_store, args.ready)


if __name__ == "__main__":
    sys.exit(main())
