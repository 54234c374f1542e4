"""One trial segment on a pool node: the flow a `campaign worker` runs when the campaign
places a trial on its node (`flows/pool/remote.py` sends it to the node's work queue).

It runs what a one-machine campaign runs in its own process (`tasks.trial`: plan, launch,
wait, the result from the trial's folder), here on the node's devices. Before launching it
leases them in the node's own lease store, so that no device of the node is given to two
trials even by two campaigns that share the pool. The trial's folder is on storage every
node shares, or (`cluster.shared_storage: false`) in a folder of the node's own, copied with
the campaign's through Prefect artifacts (`flows/pool/mirror.py`); its checkpoints, in the
shared folder or through the DVC remote, let the trial resume on another node. An elastic trial on one
node runs under its agent; its resizes there pass through `flows/pool/relay.py`, which
leases a grow in the node's lease file before the agent sees it. Grown onto other nodes, it
stays under that agent: a host segment on each new node leases its devices there and starts
the workers the agent asks for (`host`, training.elastic_host), which join in memory. Moved
off the agent's node, it is stopped and started again across the nodes, as a trial that spans nodes (below).

A trial placed over several nodes gets one segment per node (`span`). Each runs torchrun
with the c10d rendezvous (`tasks.trial.plan_node_launch`); the host node picks a free port
on its own address and writes the endpoint into the trial's folder for this attempt, where
the other nodes read it (through the campaign's copy when nothing is shared). Only the host node keeps the trial's record.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from prefect import flow
from prefect.context import FlowRunContext
from prefect.exceptions import Abort, TerminationSignal

from cluster.leases import LeaseStore
from cluster.types import WHOLE_DEVICE, Device, claim_bytes
from flows.run.live import LeaseHeartbeat
from flows.pool.mirror import NodeMirror, node_trial_dir
from flows.pool.nodes import SERVER_PATIENCE_S, PoolError, call, server_answers, server_patience
from flows.pool.secret import accept_segment, node_secret
from flows.pool.relay import CommandRelay
from tasks.trial import (LaunchPlan, NodeRole, TrialFailed, control_dir, plan_host_launch, plan_launch, plan_node_launch, revoke,
                         run_host, run_plan, stop_launched_trials)
from training.config import TrialConfig
from training.agent_commands import clear_commands
from training.agent_state import read_agent_state
from training.loopback import BIND_ENV
from training.files import read_json, write_json_atomic
from training.host_records import publish_agent_store, write_host_status
from training.layout import trial_files

NODE_ENV = "CAMPAIGN_NODE"  # set by `campaign worker`: the node's name
ADDRESS_ENV = "CAMPAIGN_NODE_ADDRESS"  # its address (a trial across nodes listens there; one on the node, on loopback)
INTERFACE_ENV = "CAMPAIGN_NODE_INTERFACE"  # and the network interface of that address
RENDEZVOUS_WAIT_S = 120.0  # how long a node waits for the host node's endpoint
CANCEL_POLL_S = 2.0  # how often a segment reads its own flow run's state (CancelWatch)
# How long it leaves a cancel to its Prefect worker first: past the worker's own worst case
# (its observer polls every 10 s, give or take 30 %, once its websocket dropped, then gives
# the run 30 s to end after SIGTERM), so that it acts only where the worker no longer does.
CANCEL_GRACE_S = 60.0
CANCEL_STOP_WAIT_S = 60.0  # the segment's end waits this long for a stop the watch began


class CancelWatch:
    """The segment's own watch on its flow run: cancelled (`Cancelling`) and not ended by its
    worker within CANCEL_GRACE_S, the segment stops its trial itself, as the campaign's stop
    does (its processes end, its devices are released). Prefect's worker ends a cancelled run
    through an observer made for each run, whose polling gives up for good once the server
    has been away for about 20 s (three failed polls; 22 s in the test's log): a run that
    lived through a restart of the server could no longer be cancelled, and a stopped
    campaign's trial trained on there, holding its devices, until it ended by itself."""

    def __init__(self, flow_run_id, on_cancel: Callable[[], object]):
        self.flow_run_id, self.on_cancel = flow_run_id, on_cancel
        self.acting = threading.Event()  # it stops the trial...
        self.acted = threading.Event()  # ...and has stopped it
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="segment-cancel-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """The segment ends: the watch acts no more, and a stop it began is waited for (not a
        poll that rides on its client's retries: it ends by itself)."""
        self._done.set()
        if self.acting.is_set():
            self.acted.wait(CANCEL_STOP_WAIT_S)

    def _run(self) -> None:
        since = None
        while not self._done.wait(CANCEL_POLL_S):
            cancelling = run_cancelling(self.flow_run_id)
            if self._done.is_set():
                return
            if not cancelling:
                since = None
            elif since is None:
                since = time.monotonic()
            elif time.monotonic() - since >= CANCEL_GRACE_S:
                self.acting.set()
                try:
                    self.on_cancel()
                finally:
                    self.acted.set()
                return


def run_cancelling(flow_run_id) -> bool:
    """Whether the run is being cancelled (False when the server does not answer)."""
    from prefect.client.schemas.objects import StateType

    try:
        run = call(lambda client: client.read_flow_run(flow_run_id))
    except Exception:  # the server away a moment: the next poll asks again
        return False
    return run.state is not None and run.state.type == StateType.CANCELLING


def mark_cancelled(flow_run_id) -> None:
    """The segment's run ends `Cancelled`, as its worker would have marked it after a cancel."""
    from prefect.states import Cancelled

    call(lambda client: client.set_flow_run_state(flow_run_id, Cancelled(message="cancelled: the segment stopped its trial"),
                                                  force=True))


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def rendezvous_role(cfg: TrialConfig, span: dict[str, Any]) -> NodeRole:
    """This node's part in a trial across `span["nnodes"]` nodes, for attempt `span["attempt"]`."""
    address = os.environ.get(ADDRESS_ENV, "127.0.0.1")
    path = trial_files(cfg.trial_dir).rendezvous(span['attempt'])
    if span["host"]:
        endpoint = f"{address}:{free_port(address)}"
        write_json_atomic(path, {"endpoint": endpoint})
    else:
        deadline = time.time() + RENDEZVOUS_WAIT_S
        while (found := read_json(path)) is None:
            if time.time() > deadline:
                raise TrialFailed(f"trial {cfg.trial_id}: the host node did not say where to meet within {RENDEZVOUS_WAIT_S:.0f} s")
            time.sleep(0.2)
        endpoint = found["endpoint"]
    return NodeRole(nnodes=span["nnodes"], host=span["host"], endpoint=endpoint, address=address,
                    interface=os.environ.get(INTERFACE_ENV, "lo"), min_nodes=span.get("min_nodes"))


def _agent_across_nodes(plan: LaunchPlan, cfg: TrialConfig, node: str) -> LaunchPlan:
    """The agent named after its node, its store (and its workers) on this node's address, where
    the hosts of the trial's other nodes reach it; the address is written where the campaign reads it."""
    address, interface = os.environ.get(ADDRESS_ENV, "127.0.0.1"), os.environ.get(INTERFACE_ENV, "lo")
    port = free_port(address)
    publish_agent_store(cfg.trial_dir, f"{address}:{port}", node)
    return dataclasses.replace(plan, command=[*plan.command, "--node", node, "--store-port", str(port)],
                               env={**plan.env, BIND_ENV: address, "GLOO_SOCKET_IFNAME": interface})


def _host_segment(cfg: TrialConfig, placed: list[Device], host: dict[str, Any], lease: dict, node: str) -> dict[str, Any]:
    """Host this node's devices of a trial whose agent is on another node, until the agent's state
    (the campaign's copy, in its numbering) from command `host["seq"]` on names none of them."""
    mine = {d.id for d in placed}

    def done() -> bool:
        state = read_agent_state(control_dir(cfg))
        return state is not None and state.seq >= host["seq"] and (state.status != "running" or not mine & set(state.devices))

    with tempfile.TemporaryDirectory(prefix="campaign-host-") as scratch:
        ready = Path(scratch) / "ready.json"  # the host's own word that it serves the agent, under its new incarnation
        plan = plan_host_launch(cfg, host["store"], node, lease, os.environ.get(ADDRESS_ENV, "127.0.0.1"),
                                os.environ.get(INTERFACE_ENV, "lo"), ready)
        # The campaign tells the agent only then: it asks the newest incarnation, never one just ended.
        code = run_host(plan, cfg, ready, lambda: write_host_status(cfg.trial_dir, node, host["seq"], "ready"), done)
    return {"host": node, "exit_code": code}


@flow(name="campaign-trial-segment", log_prints=True)
def trial_segment(config: dict[str, Any], devices: list[dict[str, Any]], cwd: str, campaign: str,
                  span: dict[str, Any] | None = None, elastic: bool = False,
                  node_devices: list[dict[str, Any]] | None = None, files: dict[str, str] | None = None,
                  signature: str | None = None, agent_across: bool = False, host: dict[str, Any] | None = None,
                  memory_bytes: int | None = None, launch_id: str | None = None, attempt_id: str | None = None,
                  expires_at: float | None = None) -> dict[str, Any]:
    """`node_devices`: every device of this node (an elastic trial may grow onto any of them).
    `memory_bytes`: the trial's memory per device where it shares its devices by memory (None:
    whole devices): what it leases of each in the node's lease file.
    `files`: the campaign's folder is not on this node (`cluster.shared_storage: false`): the
    trial runs in a folder of this node's, its files copied through these artifacts
    ({"down", "up"}: flows/pool/mirror.py), and, across nodes, rank 0 writes its whole
    checkpoint (the other nodes pull it from the DVC remote to resume).
    `agent_across`: an elastic trial's agent here may grow it onto other nodes in memory (its
    store on this node's address, published in the trial's folder: `agent-store.json`).
    `host`: {"store", "seq"}: this segment hosts, on this node, `devices` of an elastic trial
    whose agent runs on another node, from the campaign's command `seq` on, until the agent's
    state (the campaign's copy, sent down with `files` when nothing is shared) no longer
    names them (training.elastic_host).
    `launch_id`: the campaign's launch of the trial this segment is part of, named in the
    trial's shared folder while it is the trial's (training.fence.launched_again).
    `signature`: the pool key's over the other parameters; nothing runs without it (flows/pool/secret.py).
    `attempt_id`, `expires_at`: what the signature binds the segment to: this node runs each
    attempt once, and none past its expiry (a replay of a signed segment is refused)."""
    params = {"config": config, "devices": devices, "cwd": cwd, "campaign": campaign, "span": span, "elastic": elastic,
              "node_devices": node_devices}
    params |= ({"agent_across": True} if agent_across else {}) | ({"host": host} if host is not None else {})
    params |= {"memory_bytes": memory_bytes} if memory_bytes is not None else {}
    params |= {"files": files} if files is not None else {}
    params |= {"launch_id": launch_id} if launch_id is not None else {}
    # Only those sent: a segment signed without them verifies, and is then refused for lacking them.
    params |= {key: value for key, value in (("attempt_id", attempt_id), ("expires_at", expires_at)) if value is not None}
    accept_segment(node_secret(), params, signature, node=os.environ.get(NODE_ENV, ""))  # before anything is leased or run
    cfg = TrialConfig(**config)

    def say(line: str) -> None:
        print(f"trial {cfg.trial_id} on node {os.environ.get(NODE_ENV, '')}: {line}", flush=True)

    # How the segment ended reaches the campaign only through the Prefect server (its flow
    # run's state; without shared storage, its last files too): a server away as it ends (a
    # crash, a restart of its service) is waited for, or its worker would later report the run
    # crashed and, with nothing shared, its result would never be sent. Its devices are
    # released before.
    context = FlowRunContext.get()
    if context is None:  # called as a function, not as a worker's flow run: nothing to report through
        return _segment(cfg, devices, cwd, campaign, span, elastic, node_devices, files, agent_across, host, memory_bytes, launch_id)
    run_id = context.flow_run.id
    watch = CancelWatch(run_id, stop_launched_trials)
    with server_patience(SERVER_PATIENCE_S, say):
        watch.start()
        error = None
        try:
            return _segment(cfg, devices, cwd, campaign, span, elastic, node_devices, files, agent_across, host, memory_bytes,
                            launch_id)
        except BaseException as e:
            error = e
            raise
        finally:
            watch.close()
            if not isinstance(error, TerminationSignal):  # not its worker's own cancel, which Prefect ends as it does
                _report_end(run_id, watch, error, say)


def _report_end(run_id, watch: CancelWatch, error: BaseException | None, say: Callable[[str], None]) -> None:
    """After the segment's work (its devices released): wait for the server, and if the run is
    being cancelled, end it `Cancelled` and the engine with it, without a state of its own (it
    would propose Completed or Failed, which the server refuses a run being cancelled: the run
    would then stay `Cancelling` for good where its worker no longer ends cancelled runs)."""
    cancelled = False
    try:
        server_answers()
        if cancelled := run_cancelling(run_id):
            mark_cancelled(run_id)
    except Exception as e:  # the run's own end (its result, or its error) stands
        say(f"its end cannot be reported ({e.__class__.__name__}: {e})")
    if cancelled:
        by = " by the segment itself (its Prefect worker did not end it)" if watch.acted.is_set() else ""
        ended = f"; it ended with {error.__class__.__name__}: {error}" if error is not None else ""
        say(f"cancelled: its trial was stopped{by}{ended}")
        raise Abort("the segment's run was cancelled")


def _segment(cfg: TrialConfig, devices: list[dict[str, Any]], cwd: str, campaign: str, span: dict[str, Any] | None,
             elastic: bool, node_devices: list[dict[str, Any]] | None, files: dict[str, str] | None, agent_across: bool,
             host: dict[str, Any] | None, memory_bytes: int | None, launch_id: str | None) -> dict[str, Any]:
    if files is None:
        return _run_segment(cfg, devices, cwd, campaign, span, elastic, node_devices, agent_across, host, memory_bytes, launch_id)
    local = node_trial_dir(campaign, cfg.trial_id)
    # Over several nodes (torchrun's, or our agent's with hosts elsewhere) rank 0 writes each
    # whole checkpoint on its node: a node that resumes the trial alone pulls it from the remote.
    cfg = dataclasses.replace(cfg, trial_dir=str(local), one_checkpoint_writer=span is not None or agent_across or host is not None)
    clear_commands(control_dir(cfg))  # an earlier segment's here are not this one's (the campaign's start from 1)
    with NodeMirror(local, files, cfg.trial_id, os.environ.get(NODE_ENV, ""), hosting=host is not None):
        return _run_segment(cfg, devices, str(local.parent), campaign, span, elastic, node_devices, agent_across, host, memory_bytes)


def node_claims(placed: list[Device], memory_bytes: int) -> dict[str, int]:
    """What a segment leases of each of its devices in the node's lease file: the trial's
    memory per device where it shares them (several small trials on one GPU, as the campaign
    packed them), each device's capacity for whole devices (claim_bytes)."""
    return {d.id: claim_bytes(memory_bytes, d.memory_bytes) for d in placed}


def _run_segment(cfg: TrialConfig, devices: list[dict[str, Any]], cwd: str, campaign: str, span: dict[str, Any] | None,
                 elastic: bool, node_devices: list[dict[str, Any]] | None, agent_across: bool = False,
                 host: dict[str, Any] | None = None, memory_bytes: int | None = None,
                 launch_id: str | None = None) -> dict[str, Any]:
    placed = [Device(**d) for d in devices]
    memory = WHOLE_DEVICE if memory_bytes is None else memory_bytes
    node = os.environ.get(NODE_ENV, "")
    if any(d.node != node for d in placed):
        raise TrialFailed(f"trial {cfg.trial_id}: sent to node {node!r} with devices of {sorted({d.node for d in placed})}")
    store = LeaseStore()
    holder = f"{campaign}/{cfg.trial_id}@{node}:{os.getpid()}"
    capacity = {d["id"]: d["memory_bytes"] for d in node_devices or []} | {d.id: d.memory_bytes for d in placed}
    if not store.acquire(holder, node_claims(placed, memory), capacity, campaign=campaign):
        if host is not None:  # the campaign, which waits for this before it tells the agent, says the grow is refused
            write_host_status(cfg.trial_dir, node, host["seq"], "refused", f"node lease file: {', '.join(d.id for d in placed)} held by another campaign")
            return {"host": node, "refused": True}
        raise TrialFailed(f"trial {cfg.trial_id}: a device of node {node} is leased by another campaign: "
                          f"{', '.join(d.id for d in placed)}")
    heartbeat = LeaseHeartbeat(store, period_s=max(1.0, store.heartbeat_timeout_s / 4), on_lost=lambda _: revoke(cfg.trial_id))
    heartbeat.add(holder)
    lease = store.fence(holder)
    if launch_id is not None:  # ... and, in a shared folder, that this launch is still the trial's
        lease |= {"launch": launch_id, "launch_file": str(trial_files(cfg.trial_dir).launch)}
    cfg = dataclasses.replace(cfg, lease=lease)  # its workers watch the node's lease (training.fence)
    try:
        if host is not None:
            return _host_segment(cfg, placed, host, store.fence(holder), node)
        if elastic and span is None:  # its agent takes commands through the relay, which leases a grow on the node first
            inner = control_dir(cfg) / f"node-{node}"  # a node cut off, not dead, must not feed another's relay
            plan = plan_launch(cfg, placed, Path(cwd), elastic=True, control=inner)
            if agent_across:
                plan = _agent_across_nodes(plan, cfg, node)
            with CommandRelay(control_dir(cfg), inner, store, holder, capacity, [d.id for d in placed], memory):
                return run_plan(plan, cfg, placed)
        if span is None:
            return run_plan(plan_launch(cfg, placed, Path(cwd)), cfg, placed)
        if elastic:  # moved by the campaign (a resize): it stops at a checkpoint when this attempt's stop file is there
            cfg = dataclasses.replace(cfg, stop_path=str(trial_files(cfg.trial_dir).stop(span["attempt"])))
        plan = plan_node_launch(cfg, placed, Path(cwd), rendezvous_role(cfg, span), node=node)  # its own config and log
        return run_plan(plan, cfg, placed, record=span["host"], all_devices=span["devices"])
    finally:
        heartbeat.release(holder)
        heartbeat.close()
