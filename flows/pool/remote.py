"""The campaign's side of a pool: its nodes' devices, and trial segments run on them.

`run_remote_trial` is the pool's `tasks.trial.run_trial`: the same task in the campaign's
loop (a future the loop waits on), but the segment runs on the trial's node, as a flow run
of the pool's segment deployment sent to that node's work queue (`flows/pool/segment.py`). It
follows the flow run to its end and reads the result from the trial's folder, on storage
the nodes share or copied from the nodes' own folders (`flows/pool/mirror.py`). It also watches the node: when the node's worker stops beating
(`flows.pool.nodes.live`), the flow run is marked crashed and the task answers
`{"node_lost": node}` (like a preemption, an answer and not an error: the trial did
nothing wrong), and the campaign queues the trial again on the nodes that are left, where
it resumes from its last checkpoint.

A segment lives on its node, not in the campaign's process: a campaign killed outright
(SIGKILL, its machine gone) leaves its segments training there. So each flow run sent for a
trial carries the trial's tag (`segment_tag`, set as Prefect creates it: no moment where it
runs untracked), and a later launch of the trial first cancels those of an earlier launch
that have not ended and waits for them to end (`end_earlier_segments`): the trial never
trains twice at once, nor do two writers share its folder.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import task

from cluster.types import Device, Inventory
from flows.pool.mirror import CampaignMirror
from flows.pool.secret import load_secret, signed_segment
from flows.pool.nodes import (HEARTBEAT_S, MISSED_HEARTBEATS, NODE_GRACE_S, SERVER_PATIENCE_S, PoolError, PoolNode, call,
                             ensure_segment_deployment, patiently, pool_inventory, read_pool, server_patience,
                             server_trouble_within)
from tasks.records import completed_result, log_allocation, read_trial_record, update_record
from tasks.trial import TrialFailed, TrialStalled, TrialStopped, campaign_stopping, log_tail
from tasks.watchdog import FLOOR_S, Stall, StallClock, queued_again, seen_since
from training.config import TrialConfig
from training.files import write_json_atomic
from training.layout import trial_files
from training.progress import read_progress

POLL_S = 1.0  # the flow run's state, and the node's heartbeat, this often
RECALL_WAIT_S = 60.0  # how long a recalled trial's segments have to end once asked (then once cancelled)

_recalled: set[str] = set()  # trials the campaign moves to other nodes: their segments stop now
_mirrors: dict[str, CampaignMirror] = {}  # a running trial's copy of its files (no shared storage): its hosts' too


def recall(trial_id: str) -> None:
    """Stop `trial_id`'s segments on their nodes, so that the campaign starts it again elsewhere
    (a resize onto or off a node of a trial that spans nodes): its `run_remote_trial` answers
    {"preempted": True} once they have ended. An elastic trial stops at a checkpoint it
    writes then (its stop file); any other is cancelled and resumes from its last checkpoint."""
    _recalled.add(trial_id)


def forget_recall(trial_id: str) -> None:
    """The trial's segment task has ended (the campaign collected it): a recall it did not
    see must not stop the trial's next start."""
    _recalled.discard(trial_id)


def pool_nodes(pool: str) -> list[PoolNode]:
    return call(lambda client: read_pool(client, pool))


def live_inventory(pool: str) -> Inventory:
    """The devices of the pool's live nodes; PoolError when there is none."""
    nodes = pool_nodes(pool)
    inventory = pool_inventory(nodes)
    if not inventory.devices:
        dead = f" ({', '.join(n.name for n in nodes)} not beating)" if nodes else ""
        raise PoolError(f"pool {pool!r} has no live node{dead}: start `campaign worker --pool {pool}` on each node")
    return inventory


CODE_ROOT = Path(__file__).resolve().parents[2]  # where flows/pool/segment.py is, the same path on every node


def prepare_pool(pool: str) -> str:
    """The pool's segment deployment, run from this code's folder on the nodes; its name."""
    return call(lambda client: ensure_segment_deployment(client, pool, str(CODE_ROOT)))


def _mark_crashed(flow_run_id, message: str) -> None:
    from prefect.states import Crashed

    call(lambda client: client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True))


def _cancel(flow_run_id, message: str = "the campaign is stopping") -> None:
    from prefect.states import Cancelling

    call(lambda client: client.set_flow_run_state(flow_run_id, Cancelling(message=message), force=True))


def segment_tag(campaign: str, trial_id: str) -> str:
    """The Prefect tag of every flow run sent for the trial (its segments, its hosts)."""
    return f"segment:{campaign}/{trial_id}"


def _unended(tag: str) -> list:
    """The flow runs tagged `tag` that have not ended (running, pending, being cancelled...)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, FlowRunFilterTags
    from prefect.client.schemas.objects import StateType

    final = [StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED, StateType.CRASHED]
    runs = FlowRunFilter(tags=FlowRunFilterTags(all_=[tag]), state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=final)))
    return call(lambda client: client.read_flow_runs(flow_run_filter=runs))


def end_earlier_segments(config: TrialConfig, campaign: str, pool: str, wait_s: float = RECALL_WAIT_S) -> None:
    """Before a trial is sent again: every flow run an earlier launch sent for it and that has
    not ended (its campaign was killed, and the segment trains on) is cancelled, and waited
    for. One on a node no longer beating is marked crashed (nothing there can be ended).
    TrialFailed, naming it, if one on a live node does not end within `wait_s`."""
    # Those found now, and only those: a host segment this launch starts meanwhile carries the tag too.
    running = {run.id: run.work_queue_name for run in _unended(segment_tag(campaign, config.trial_id))}
    for run_id, node in running.items():
        print(f"trial {config.trial_id}: its segment on node {node} from an earlier launch is still running "
              f"(flow run {run_id}): cancelling it before the trial starts again", flush=True)
        _cancel(run_id, "the trial was launched again: this segment of an earlier launch ends first")
    deadline = time.time() + wait_s
    while running := {run_id: node for run_id, node in running.items() if not _ended(run_id)}:
        if time.time() > deadline:
            alive = {n.name for n in pool_nodes(pool) if n.live}
            if live := [(run_id, node) for run_id, node in running.items() if node in alive]:
                raise TrialFailed(f"trial {config.trial_id}: its segment on node {live[0][1]} from an earlier launch "
                                  f"(flow run {live[0][0]}) did not end when cancelled: stop it (the Prefect UI, or that node's "
                                  f"`campaign worker`), then launch again")
            for run_id, node in running.items():
                _mark_crashed(run_id, f"node {node} stopped beating")
            break
        time.sleep(POLL_S)


# How long the peers of a node that vanished (powered off, cut off: no connection reset) may
# wait in a collective before torchrun restarts them: NCCL's default timeout (gloo's is shorter).
COLLECTIVE_TIMEOUT_S = 600.0
LOST_WITHIN_S = MISSED_HEARTBEATS * HEARTBEAT_S + 2 * POLL_S  # a dead node's heartbeats are missed by then


def _lost_within(pool: str, nodes: list[str], seconds: float) -> str | None:
    """The first of `nodes` seen dead within `seconds`, or None."""
    deadline = time.time() + seconds
    while True:
        alive = {n.name for n in pool_nodes(pool) if n.live}
        if (dead := [node for node in nodes if node not in alive]) and not server_trouble_within(NODE_GRACE_S):
            return dead[0]
        if time.time() > deadline:
            return None
        time.sleep(POLL_S)


def _ended(flow_run_id) -> bool:
    from prefect.exceptions import ObjectNotFound

    try:
        state = call(lambda client: client.read_flow_run(flow_run_id)).state
    except ObjectNotFound:  # deleted (by hand, by retention): nothing of it runs
        return True
    return state is not None and state.is_final()


def _all_ended(runs: dict[str, Any], states: dict[str, Any], within_s: float) -> bool:
    """Whether every flow run of `runs` (those not in `states`) ended within `within_s`."""
    deadline = time.time() + within_s
    while not (ended := all(node in states or _ended(run_id) for node, run_id in runs.items())) and time.time() < deadline:
        time.sleep(POLL_S)
    return ended


def agent_across_nodes(config: TrialConfig, elastic: bool, nodes: int) -> bool:
    """Whether a pool trial runs under our agent, which grows it onto other nodes and shrinks it
    off them in memory: an elastic trial of our trainer started on one node. Anything else
    moves across nodes by a stop and a start (torchrun across them: `Running.relaunch`)."""
    return elastic and nodes == 1 and config.function is None


def start_host(config: TrialConfig, node: str, devices: list[Device], node_devices: list[Device], cwd: str, deployment: str,
               pool: str, campaign: str, store: str, seq: int, shared_storage: bool = True, memory_bytes: int | None = None) -> str | None:
    """Send node `node` the segment that hosts `devices` of a trial whose agent (on another node)
    listens at `store`, for the campaign's command `seq` on (flows/pool/segment.py `host`); its
    flow run's id. It leases them in the node's own file first and says so in the trial's
    `host-<node>.json`, which the campaign waits for before it tells the agent. Without shared
    storage its files travel with those of the trial's running attempt (None: it has none now)."""
    from prefect.deployments import run_deployment

    params = {"config": asdict(config), "devices": [asdict(d) for d in devices], "cwd": cwd, "campaign": campaign, "span": None,
              "elastic": True, "node_devices": [asdict(d) for d in node_devices], "host": {"store": store, "seq": seq}}
    if memory_bytes is not None:  # shares its devices by memory (None: whole devices)
        params["memory_bytes"] = memory_bytes
    if not shared_storage:
        if (mirror := _mirrors.get(config.trial_id)) is None:
            return None
        params["files"] = mirror.add(node)
    signed = signed_segment(load_secret(pool), params)
    run = patiently(lambda: run_deployment(deployment, parameters=signed, work_queue_name=node, timeout=0,
                                           flow_run_name=f"{config.trial_id} host on {node}", tags=[segment_tag(campaign, config.trial_id)]))
    return str(run.id)


def end_host(flow_run_id: str) -> None:
    """A host segment the campaign no longer wants (another node refused the grow it was for)."""
    _cancel(flow_run_id)


def by_node(devices: list[Device]) -> list[tuple[str, list[Device]]]:
    """A placement's devices grouped by node, nodes in rank order (the first hosts the rendezvous)."""
    groups: dict[str, list[Device]] = {}
    for d in devices:
        groups.setdefault(d.node, []).append(d)
    return list(groups.items())


@task
def run_remote_trial(config: TrialConfig, devices: list[Device], cwd: str, deployment: str, pool: str, campaign: str,
                     elastic: bool = False, node_devices: list[Device] = (), shared_storage: bool = True,
                     memory_bytes: int | None = None) -> dict[str, Any]:
    """One segment of a trial on its node(s) of `pool`: the trial's result, {"preempted": True}
    (an elastic trial resized to zero), or {"node_lost": node}. `node_devices`: every device of
    an elastic trial's node, which it may grow onto. `shared_storage`: the nodes see the
    trial's folder; else the node keeps its own and the files travel through the Prefect
    API (flows/pool/mirror.py), copied here every poll. `memory_bytes`: the trial's memory per
    device where it shares its devices by memory (None: whole devices), leased on each node.

    A trial placed on several nodes gets one flow run per node (torchrun's c10d rendezvous
    between them). It is elastic across them (`--nnodes=1:N`, tasks/trial.py): when a node
    other than the host (the first, which holds the rendezvous store) is lost, the nodes left
    go on from the trial's last checkpoint without it, and the trial ends where it would have
    (its result does not depend on the world size); when that node's worker beats again, its
    segment is sent again and the trial takes it back in. When the host's node is lost, or a
    segment fails, the others are cancelled, so no node keeps waiting in a collective for a
    peer that is gone, and the campaign queues the trial again. A function trial (the user's
    loop, whose state we do not know) is not elastic across nodes.
    """
    if campaign_stopping(config.trial_id):
        raise TrialStopped(f"trial {config.trial_id}: not sent to the pool, the campaign is stopping")
    # A server that stops answering (a crash, its host's service restarted) is waited for: the
    # segments train on meanwhile, and failing the trial would leave them with nobody following.
    try:
        with server_patience(SERVER_PATIENCE_S, lambda line: print(f"trial {config.trial_id}: {line}", flush=True),
                             give_up=lambda: campaign_stopping(config.trial_id)):
            return _run_remote_trial(config, devices, cwd, deployment, pool, campaign, elastic, node_devices, shared_storage,
                                     memory_bytes)
    except PoolError:
        if campaign_stopping(config.trial_id):  # it stopped waiting for the server because the campaign stops
            raise TrialStopped(f"trial {config.trial_id} was stopped with its campaign; it resumes from its last checkpoint") from None
        raise


def _run_remote_trial(config: TrialConfig, devices: list[Device], cwd: str, deployment: str, pool: str, campaign: str,
                      elastic: bool, node_devices: list[Device], shared_storage: bool, memory_bytes: int | None) -> dict[str, Any]:
    end_earlier_segments(config, campaign, pool)
    reason_before = read_trial_record(Path(config.trial_dir)).reason  # before its host segment's start clears it
    groups = by_node(devices)
    attempt = uuid.uuid4().hex[:12]
    if shared_storage:
        # This launch is the trial's now: a segment of an earlier one on a node the campaign
        # lost but that lives on (cut off from the server, the folder still mounted) stops
        # itself and commits nothing more here (training.fence.launched_again).
        write_json_atomic(trial_files(config.trial_dir).launch, {"launch": attempt, "at": time.time()})
    across = len(groups) > 1 and config.function is None  # rides through the loss of a node other than the host
    # On one node under our agent, which grows it onto other nodes in memory (hosts there: start_host).
    agent_across = agent_across_nodes(config, elastic, len(groups))
    segments = {}  # node -> its segment's parameters (sent again to a node that comes back)
    for i, (node, mine) in enumerate(groups):
        span = ({"nnodes": len(groups), "host": i == 0, "attempt": attempt, "devices": [d.id for d in devices],
                 "min_nodes": 1 if across else None}
                if len(groups) > 1 else None)
        segments[node] = {"config": asdict(config), "devices": [asdict(d) for d in mine], "cwd": cwd, "campaign": campaign,
                          "span": span, "elastic": elastic, "node_devices": [asdict(d) for d in node_devices]}
        if shared_storage:
            segments[node]["launch_id"] = attempt
        if agent_across:
            segments[node]["agent_across"] = True
        if memory_bytes is not None:
            segments[node]["memory_bytes"] = memory_bytes
    mirror = None if shared_storage else CampaignMirror(Path(config.trial_dir), attempt, config.trial_id)
    if mirror is not None:
        mirror.start()  # the nodes find the campaign's files (and the trial's record) when they begin
        _mirrors[config.trial_id] = mirror  # its host segments' files travel with this attempt's (start_host)
    try:
        return _follow_segments(config, devices, pool, elastic, attempt, across, segments, mirror, deployment,
                                segment_tag(campaign, config.trial_id), reason_before)
    finally:
        if mirror is not None and _mirrors.get(config.trial_id) is mirror:
            del _mirrors[config.trial_id]


def _follow_segments(config: TrialConfig, devices: list[Device], pool: str, elastic: bool, attempt: str, across: bool,
                     segments: dict[str, dict], mirror: CampaignMirror | None, deployment: str, tag: str,
                     reason_before: str | None) -> dict[str, Any]:
    """run_remote_trial's segments (`segments`: node -> its parameters), sent with `tag` and
    followed until the trial ends on them. `reason_before`: the trial's record's reason as
    this launch began (a resize that hung before it: tasks.watchdog.queued_again)."""
    from prefect.deployments import run_deployment

    secret = load_secret(pool)  # the node runs a segment only if the pool's key signed it (flows/pool/segment.py)

    def copy_files(last: bool = False) -> None:
        if mirror is None:
            return
        try:
            mirror.pull() if last else mirror.tick()
        except Exception as e:  # the server away a moment, or it refused one call: the next poll copies again
            print(f"trial {config.trial_id}: could not copy its files with its nodes ({e.__class__.__name__}: {e})", flush=True)

    def send(node: str):
        if mirror is not None:  # the artifacts its files travel through, its own each time it is sent
            segments[node]["files"] = mirror.add(node)
        signed = signed_segment(secret, segments[node])  # a new attempt each send: a node runs each once (a retried send too)
        return patiently(lambda: run_deployment(deployment, parameters=signed, work_queue_name=node, timeout=0,
                                                flow_run_name=f"{config.trial_id} on {node}", tags=[tag])).id

    runs = {node: send(node) for node in segments}

    def cancel_others() -> None:
        for other, run_id in runs.items():
            if other not in states:
                _cancel(run_id)

    def node_lost(node: str) -> dict[str, Any]:
        copy_files(last=True)
        if node not in states:  # its flow run will never say how it ended
            _mark_crashed(runs[node], f"node {node} stopped beating")
            states[node] = None
        cancel_others()
        return {"node_lost": node}

    def record_nodes(reason: str) -> None:  # what it runs on now, in the campaign's allocation log
        log_allocation(Path(config.trial_dir).parent, config.trial_id, [d.id for d in devices if d.node not in away], reason)

    def left_behind(nodes: list[str]) -> None:
        for node in nodes:
            _mark_crashed(runs[node], f"node {node} stopped beating; the trial goes on without it")
            states[node] = None
            away.add(node)
            restarting()
            record_nodes("node left")
            print(f"trial {config.trial_id}: node {node} stopped beating; it goes on without it from its last checkpoint "
                  f"on {', '.join(n for n in runs if n not in away)}", flush=True)

    def take_back(nodes: list[str]) -> None:
        """A node it left is live again (its worker restarted): its segment is sent again, to
        the same rendezvous; the trial's agents see it waiting and restart with it."""
        for node in nodes:
            away.discard(node)
            states.pop(node, None)
            runs[node] = send(node)
            restarting()
            record_nodes("node back")
            print(f"trial {config.trial_id}: node {node} is back; it takes the node in again from its last checkpoint", flush=True)

    def stalled(stall: Stall) -> dict[str, Any]:
        """Its step stood still past the limit: every segment cancelled and waited for, then
        the trial queued again (a resize that hung, the first time) or failed for good, as a
        stall on one machine (tasks/watchdog.py)."""
        print(f"trial {config.trial_id} {stall.reason}: its segments on {', '.join(runs)} are cancelled "
              "(training.stall_timeout_s)", flush=True)
        for node, run_id in runs.items():
            if node not in states:
                _cancel(run_id, f"the trial {stall.reason} (training.stall_timeout_s)")
        _all_ended(runs, states, RECALL_WAIT_S)
        copy_files(last=True)
        if (result := completed_result(Path(config.trial_dir))) is not None:
            return result  # it finished as it was stopped
        if queued_again(stall, reason_before):
            update_record(Path(config.trial_dir), state="preempted", reason=stall.reason)
            return {"preempted": True, "stalled": stall.reason}
        update_record(Path(config.trial_dir), state="failed", reason=stall.reason)
        raise TrialStalled(f"trial {config.trial_id} {stall.reason}: stopped on {', '.join(runs)}, not retried "
                           f"(training.stall_timeout_s: {config.stall_timeout_s}; raise it, or null, if it was only slow)")

    host = next(iter(segments))  # the first node, which holds the rendezvous
    states: dict[str, Any] = {}
    away: set[str] = set()  # nodes it went on without
    # Over several nodes no node's own watchdog can judge it (rank 0 may write its progress on
    # another node), so the campaign does, from its copy of the trial's progress.
    clock = StallClock(config.stall_timeout_s, time.monotonic()) if len(runs) > 1 and config.stall_timeout_s is not None else None
    at_launch = read_progress(config.trial_dir)  # what an earlier segment left: judged by change, not by the nodes' clocks

    def restarting() -> None:  # the nodes left restart it from its checkpoint: a resize's time, and their peers' collective timeout
        if clock is not None:
            now = read_progress(config.trial_dir) or at_launch
            clock.restarted(now.step if now is not None else 0, FLOOR_S + COLLECTIVE_TIMEOUT_S, time.monotonic())
    while len(states) < len(runs):
        time.sleep(POLL_S)
        copy_files()
        if clock is not None and (stall := clock.observe(seen_since(read_progress(config.trial_dir), at_launch), time.monotonic())):
            return stalled(stall)
        for node, run_id in runs.items():
            if node not in states and (state := call(lambda client: client.read_flow_run(run_id)).state) is not None and state.is_final():
                states[node] = state
        if across and states.get(host) is not None and states[host].is_completed() and len(states) < len(runs):
            cancel_others()  # the trial has ended on its host: a node taken back too late waits for nobody
            break
        failed = [node for node, state in states.items() if state is not None and not state.is_completed()]
        if failed and len(states) < len(runs) and not (across and host not in failed and host not in states):
            # A peer that died makes the others fail at once (the connection is reset), well
            # before its heartbeats are missed: wait that long before blaming the trial.
            if lost := _lost_within(pool, [node for node in runs if node not in failed], LOST_WITHIN_S):
                return node_lost(lost)
            cancel_others()
            break
        if config.trial_id in _recalled:
            _recalled.discard(config.trial_id)
            # Its devices are leased again for its next start: wait until each node's segment
            # has ended, and with it the trial's processes and its lease in the node's file.
            # An elastic trial across nodes stops at a checkpoint when asked (its stop file);
            # one that does not (a function trial, or one that hangs) is cancelled, and
            # resumes from its last checkpoint.
            if across and elastic:
                write_json_atomic(trial_files(config.trial_dir).stop(attempt), {"at": time.time()})
                copy_files()  # without shared storage the stop file reaches the nodes through this copy
                if not _all_ended(runs, states, RECALL_WAIT_S):
                    cancel_others()
            else:
                cancel_others()
            _all_ended(runs, states, RECALL_WAIT_S)
            copy_files(last=True)
            return completed_result(Path(config.trial_dir)) or {"preempted": True}  # it may have ended meanwhile
        if campaign_stopping(config.trial_id):
            cancel_others()
            raise TrialStopped(f"trial {config.trial_id} was stopped with its campaign; it resumes from its last checkpoint")
        nodes_now = pool_nodes(pool)
        if server_trouble_within(NODE_GRACE_S):
            continue  # the nodes' heartbeats had nowhere to go while the server was away: none is judged by them yet
        alive = {n.name for n in nodes_now if n.live}
        if lost := [node for node in runs if node not in states and node not in alive]:
            if across and host not in lost:
                left_behind(lost)
                continue
            return node_lost(lost[0])
        if back := [node for node in away if node in alive and host not in states]:
            take_back(back)
    copy_files(last=True)  # the segment's last copy (its result, record and log) was sent before its run ended
    result = completed_result(Path(config.trial_dir))
    if result is not None:
        return result
    if elastic and all(state is not None and state.is_completed() for state in states.values()):
        return {"preempted": True}  # its segment ended in order without a result: its agent was told to stop
    ended = "; ".join(f"{node}: {state.type.value} ({state.message})" for node, state in states.items() if state is not None)
    raise TrialFailed(f"trial {config.trial_id} on {', '.join(runs)}: {ended}; end of its log:\n"
                      f"{log_tail(trial_files(config.trial_dir).log)}")
