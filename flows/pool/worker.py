"""`campaign worker --pool NAME`: make this machine a node of a campaign pool.

It publishes the node's devices (pynvml, or CPU slots) and address in the pool
(`flows/pool/nodes.py`), then runs Prefect's own process worker on the node's work queue, so
trial segments placed on this node run here (`flows/pool/segment.py`), with:
- `CAMPAIGN_NODE`: the node's name, which a segment checks its devices against;
- `CAMPAIGN_NODE_ADDRESS`: the node's address, where the stores and rendezvous of a trial
  across nodes listen (a trial on the node alone keeps to its loopback);
- `CAMPAIGN_NODE_INTERFACE`: the interface with that address, gloo's across nodes;
- Prefect's heartbeat every few seconds, by which the campaign sees a dead node.
Ctrl-C (or SIGTERM) stops the worker and withdraws the node; a node killed outright keeps
its record, and its missing heartbeats take it out of the pool.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

from cluster.inventory import discover
from flows.pool.nodes import HEARTBEAT_S, PoolError, call, check_name, ensure_pool, ensure_queue, publish_node, withdraw_node
from flows.pool.segment import ADDRESS_ENV, INTERFACE_ENV, NODE_ENV
from training.files import private_temp_dir
from training.process import die_with_parent, stop_process_groups

POLL_S = 1  # how often the Prefect worker asks for work: a placed segment starts within about this


def require_server() -> str:
    api = os.environ.get("PREFECT_API_URL")
    if not api:
        raise PoolError("a pool needs a Prefect server every node reaches: start one (`campaign ui`, or `prefect server "
                        "start --host ADDRESS`) and set PREFECT_API_URL=http://ADDRESS:PORT/api on every node")
    return api


def register(pool: str, node: str, address: str, cpu_slots: int | None):
    """Create the pool and this node's queue if needed and publish the node; its inventory."""
    inventory = discover(cpu_slots=cpu_slots, node=node)

    async def publish(client) -> None:
        await ensure_pool(client, pool)
        await ensure_queue(client, pool, node)
        await publish_node(client, pool, node, address, inventory)

    call(publish)
    return inventory


def withdraw(pool: str, node: str) -> None:
    call(lambda client: withdraw_node(client, pool, node))


def worker_command(pool: str, node: str) -> list[str]:
    return [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--work-queue", node, "--name", node,
            "--type", "process"]


def interface_of(address: str) -> str:
    """The network interface that holds `address` on this machine (gloo's transport across nodes)."""
    if address.startswith("127."):
        return "lo"
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise PoolError(f"cannot list this machine's addresses ({e}): give the interface of {address} with --interface") from None
    for line in out.splitlines():  # "2: eth0    inet 10.0.0.2/24 brd ..."
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == address:
            return fields[1]
    raise PoolError(f"no interface of this machine has the address {address}: give this node's own address with --address")


def python_here() -> str:
    """A new private folder whose `python` runs this interpreter: a script, since a link to a
    virtual environment's interpreter from elsewhere would not find its environment."""
    folder = str(private_temp_dir("campaign-worker-bin-"))
    script = os.path.join(folder, "python")
    with open(script, "w") as out:
        out.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    os.chmod(script, 0o700)
    return folder


def worker_env(node: str, address: str, interface: str, python_dir: str) -> dict[str, str]:
    """`python_dir`: a folder whose `python` is this interpreter, put first on the PATH (the
    segment deployment's command is `python -m prefect.engine`: flows/pool/nodes.py)."""
    path = os.pathsep.join([python_dir, os.environ.get("PATH", os.defpath)])
    return {**os.environ, "PATH": path, NODE_ENV: node, ADDRESS_ENV: address, INTERFACE_ENV: interface,
            "PREFECT_WORKER_HEARTBEAT_SECONDS": str(HEARTBEAT_S), "PREFECT_WORKER_QUERY_SECONDS": str(POLL_S),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def run_worker(pool: str, node: str, address: str, cpu_slots: int | None, interface: str | None = None,
               say: Callable[[str], None] = print) -> int:
    """Publish the node, run Prefect's worker until it exits or we are stopped; its exit code."""
    check_name("pool", pool)
    check_name("node", node)
    api = require_server()
    interface = interface or interface_of(address)
    inventory = register(pool, node, address, cpu_slots)
    python_dir = python_here()
    env = worker_env(node, address, interface, python_dir)
    process = subprocess.Popen(worker_command(pool, node), env=env, start_new_session=True,
                               preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    say(f"node {node} ({address}) in pool {pool} on {api}: {len(inventory.devices)} {inventory.kind} device(s) "
        f"({', '.join(d.id for d in inventory.devices)}); Ctrl-C withdraws it")
    stopping = []

    def stop(signum, frame) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while process.poll() is None and not stopping:
            time.sleep(0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if process.poll() is None:
            stop_process_groups([process.pid], grace_s=20.0)
        shutil.rmtree(python_dir, ignore_errors=True)
        try:
            withdraw(pool, node)
        except Exception as e:  # the server may be what went away
            say(f"node {node}: could not withdraw from pool {pool} ({e.__class__.__name__}: {e})")
    return 0 if stopping else (process.returncode or 0)
