"""What the campaign flow keeps about running trials: leases kept alive, resizes applied.

Orchestration only: the device choice is cluster.packing.resize_devices, the lease
bookkeeping is cluster.leases, the mechanism is the trial's agent (training/elastic.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from cluster.inventory import visible_devices_env
from cluster.leases import LeaseLost, LeaseStore, LeaseStoreBusy
from cluster.packing import resize_devices
from cluster.sizing import SizedRequest
from cluster.types import Device, Inventory, claim_bytes
from tasks.grid import Trial
from tasks.resize import answer, pending_request
from training.agent_commands import read_refusal, write_command
from training.agent_state import read_agent_state
from training.config import TrialConfig
from training.host_records import read_host_status
from training.layout import trial_files


log = logging.getLogger(__name__)


# Between renewals the heartbeat looks whether the lease file was made again this often: its
# holders re-register at once, within the grace period of a rebuild by a campaign whose
# timeout is shorter than theirs (their trials' workers stop at 3/4 of it: training.fence).
REBUILT_POLL_S = 2.0


class LeaseHeartbeat:
    """Renews this campaign's leases while trials run, so other campaigns see us alive."""

    def __init__(self, store: LeaseStore, period_s: float, on_lost: Callable[[str], None] | None = None,
                 passed_on: Callable[[str], bool] | None = None):
        """on_lost(holder): the holder's leases were reclaimed; called once, in a thread of its own.
        passed_on(holder): whether a warm worker passed the holder's device on to the next trial
        itself (tasks/warm_worker.py), before the campaign heard of it: gone, not lost."""
        self.store, self.period_s, self.on_lost = store, period_s, on_lost
        self.passed_on = passed_on or (lambda holder: False)
        self.holders: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failures = 0  # renewals failed in a row (the thread goes on renewing)
        self.renewed_at = time.time()  # every holder renewed then (or none held): others see our leases live until + timeout
        self.unreleased: set[str] = set()  # released while the file was locked: given back when it frees
        self._thread = threading.Thread(target=self._run, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def add(self, holder: str) -> None:
        with self._lock:
            self.holders.add(holder)

    def release(self, holder: str) -> None:
        """Stop renewing `holder` and give its devices back; if the lease file is locked now,
        they are given back later (`release_pending`): a finished trial is never held up by it."""
        with self._lock:
            self.holders.discard(holder)
        try:
            self.store.release(holder)
        except LeaseStoreBusy as e:
            log.warning("releasing %s waits for the lease file: %s", holder, e)
            with self._lock:
                self.unreleased.add(holder)

    def pass_on(self, holder: str, to: str, claims: Mapping[str, int], capacity: Mapping[str, int], campaign: str) -> bool:
        """`holder`'s devices given back and `to`'s claims taken in one transaction of the
        lease file (LeaseStore.acquire's `instead_of`); False if they were not granted (or
        the file is locked: `holder`'s are then given back later, as `release` does)."""
        with self._lock:
            self.holders.discard(holder)
        try:
            granted = self.store.acquire(to, claims, capacity, campaign=campaign, instead_of=holder)
        except LeaseStoreBusy:
            self.release(holder)
            return False
        if granted:
            self.add(to)
        return granted

    def passed(self, holder: str, to: str) -> None:
        """A warm worker gave `holder`'s devices to `to` itself (tasks/warm_worker.py): renew `to` from now on."""
        with self._lock:
            self.holders.discard(holder)
            self.holders.add(to)

    def release_pending(self) -> None:
        """Give back what `release` could not (raises LeaseStoreBusy while the file stays locked)."""
        for holder in list(self.unreleased):
            self.store.release(holder)
            with self._lock:
                self.unreleased.discard(holder)

    @property
    def deadline(self) -> float:
        """When this campaign's leases expire unless renewed (its trials' renew deadline)."""
        return self.renewed_at + self.store.heartbeat_timeout_s

    def _run(self) -> None:
        due = time.monotonic() + self.period_s
        while not self._stop.wait(min(self.period_s, REBUILT_POLL_S)):
            if time.monotonic() < due:
                try:
                    if not self.store.rebuilt():
                        continue
                except Exception:  # a locked file: the renewal when due says what is wrong
                    continue
            due = time.monotonic() + self.period_s
            with self._lock:
                holders = list(self.holders)
            started, ok = time.time(), True
            for holder in holders:
                try:
                    self.store.renew(holder)
                    self.failures = 0
                except LeaseLost as e:  # its devices may be another campaign's now: the trial must stop at once
                    with self._lock:
                        if holder not in self.holders or self.passed_on(holder):  # given back (or on), not lost
                            self.holders.discard(holder)
                            continue
                        self.holders.discard(holder)
                    log.error("%s", e)
                    if self.on_lost is not None:
                        threading.Thread(target=self.on_lost, args=(holder,), name="lease-lost", daemon=True).start()
                except Exception as e:  # a locked or full database: try again next period, never stop renewing
                    ok = False
                    self.failures += 1
                    log.warning("renewing the lease of %s failed (%d in a row): %s", holder, self.failures, e)
            if ok:
                self.renewed_at = started

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for holder in list(self.holders):
            self.release(holder)
        try:
            self.release_pending()
        except LeaseStoreBusy as e:  # our process ends next: its rows go with it (holder gone)
            log.warning("leases left for the lease file's sweep: %s", e)


@dataclass
class Running:
    trial: Trial
    request: SizedRequest
    devices: list[Device]
    holder: str
    run_id: str
    trial_dir: Path
    elastic: bool
    warm: bool = False  # in a warm worker (tasks.trial): the next trial may be staged after it
    started_at: float = field(default_factory=time.time)
    next_seq: int = 1
    awaiting: tuple[int, list[Device], str] | None = None  # (agent seq, devices, request id) not yet applied
    handled: set[str] = field(default_factory=set)
    pinned_by_person: bool = False  # the last request a person made was accepted: the policy keeps off
    # A pool's trial moving onto other nodes (or off them): the devices it starts on again once
    # stopped, and the request that asked for it (answered when it has started there).
    relaunch: tuple[list[Device], str] | None = None
    # A pool's trial under our agent on this node, which grows it onto other nodes and shrinks it
    # off them in memory (flows.pool.remote.agent_across_nodes); None: it moves by a relaunch.
    agent_node: str | None = None
    config: TrialConfig | None = None  # the config its agent started from: its hosts start from it too
    # A grow onto other nodes waiting for their hosts: (command seq, devices, request id,
    # node -> its host segment's flow run, since when).
    hosting: tuple[int, list[Device], str, dict[str, str], float] | None = None

    @property
    def device_ids(self) -> list[str]:
        return [d.id for d in self.devices]

    @property
    def spans_nodes(self) -> bool:
        return len({d.node for d in self.devices}) > 1


@dataclass(frozen=True)
class Hosts:
    """How the campaign starts and ends a pool trial's host segment on another node (flows.pool.remote)."""

    start: Callable[[Running, str, list[Device], int], str | None]  # (job, node, its devices there, seq) -> flow run id, None: not now
    end: Callable[[str], None]


HOST_START_S = 180.0  # a host segment that has not leased and started by then: the grow is refused


def agent_devices(job: Running, devices: list[Device]) -> list[dict]:
    """A command's devices: each with its environment and, for an agent that spans nodes, its node."""
    return [{"id": d.id, "env": visible_devices_env([d]), **({"node": d.node} if job.agent_node else {})} for d in devices]


def new_host_nodes(job: Running, devices: list[Device]) -> list[str] | None:
    """The nodes an in-memory resize of `job` to `devices` needs a host started on, or None when it
    cannot be done in memory: not under an agent that spans nodes, no device left on the agent's
    node (rank 0 stays there), or more devices on a node it already has a host on (its lease there
    is the host's, made for the devices it has)."""
    if job.agent_node is None or not any(d.node == job.agent_node for d in devices):
        return None
    held = {d.node for d in job.devices}
    for node in {d.node for d in devices} & held - {job.agent_node}:
        if {d.id for d in devices if d.node == node} - set(job.device_ids):
            return None
    return sorted({d.node for d in devices} - held)


def serve_hosting(job: Running, store: LeaseStore, hosts: Hosts) -> str | None:
    """A grow onto other nodes once their hosts have leased their devices there and started: the
    agent is told then (a host it waits for would otherwise hold up the trial); refused or
    too late on any node, the grow is answered rejected and the hosts started for it ended."""
    assert job.hosting is not None
    seq, devices, request_id, runs, since = job.hosting
    statuses = {}
    for node in runs:
        status = read_host_status(job.trial_dir, node)
        statuses[node] = status if status is not None and status.seq == seq else None
    refused = {node: s.reason or "refused" for node, s in statuses.items() if s is not None and s.status == "refused"}
    if not refused and all(s is not None and s.status == "ready" for s in statuses.values()):
        write_command(trial_files(job.trial_dir).control, seq, agent_devices(job, devices))
        job.next_seq, job.awaiting, job.hosting = seq + 1, (seq, devices, request_id), None
        return f"trial {job.trial.id}: hosts ready on {', '.join(runs)}; resize to {len(devices)} device(s) requested"
    if not refused and time.time() - since < HOST_START_S:
        return None
    why = "; ".join(f"{node}: {reason}" for node, reason in refused.items()) or \
        f"no host started on {', '.join(n for n, s in statuses.items() if s is None)} within {HOST_START_S:.0f} s"
    job.hosting = None
    for node, run in runs.items():
        if node not in refused:
            hosts.end(run)
    store.release_devices(job.holder, [d.id for d in devices if d not in job.devices])
    answer(job.trial_dir, request_id, "rejected", f"trial {job.trial.id} stays on {', '.join(job.device_ids)}: {why}")
    return f"trial {job.trial.id}: resize to {len(devices)} device(s) refused ({why})"


def adopt_agent_shrink(job: Running, store: LeaseStore) -> str | None:
    """An agent that spans nodes went on without a node it lost (training.elastic): the trial's
    devices are the ones it trains on now, and the lost node's go back."""
    state = read_agent_state(trial_files(job.trial_dir).control)
    if state is None or state.status != "running" or state.seq != job.next_seq - 1 or not state.devices:
        return None
    left = [d for d in job.devices if d.id not in state.devices]
    if not left or not set(state.devices) <= set(job.device_ids):
        return None
    job.devices = [d for d in job.devices if d.id in state.devices]
    store.release_devices(job.holder, [d.id for d in left])
    lost = ", ".join(sorted({d.node for d in left}))
    return f"trial {job.trial.id}: its agent went on without node {lost} (lost): now on {', '.join(job.device_ids)}"


def claims(job: Running, devices: list[Device]) -> dict[str, int]:
    memory = job.request.at(len(devices)).memory_bytes if devices else 0
    return {d.id: claim_bytes(memory, d.memory_bytes) for d in devices}


def resize_landed(state, seq: int, devices) -> bool:
    """Whether the agent's state (training.agent_state) has command `seq` applied on `devices`."""
    return state is not None and state.seq >= seq and sorted(state.devices) == sorted(d.id for d in devices)


def serve_resizes(job: Running, inventory: Inventory, store: LeaseStore, capacity: dict[str, int],
                  recall: Callable[[str], None] | None = None, hosts: Hosts | None = None) -> str | None:
    """Move a running elastic trial's pending resize one step on; a line to log, if any.

    `recall`: in a pool, where a trial may span nodes, what stops a trial that spans them
    (`flows.pool.remote.recall`). A resize onto other nodes, or of a trial that spans nodes,
    is not done in place by the trial's agent (one node's): the trial stops at a checkpoint
    and starts again on the new devices (`Running.relaunch`, done by the campaign once it
    has stopped), a torchrun across the nodes (`--nnodes=1:N`). `hosts`: in a pool (whether or
    not its nodes share the trial's folder), a trial under our agent (`job.agent_node`) grows onto other nodes
    and shrinks off them in memory instead: a host segment on each new node first, then the
    agent's command; and when its agent went on without a node it lost, the campaign adopts it."""
    if job.relaunch is not None:
        return None  # the campaign starts it on its new devices once it has stopped
    control = trial_files(job.trial_dir).control
    if job.hosting is not None and hosts is not None:
        return serve_hosting(job, store, hosts)
    if job.awaiting is not None:
        seq, devices, request_id = job.awaiting
        if (refused := read_refusal(control, seq)) is not None:  # a pool node's lease file said no
            job.awaiting = None
            store.release_devices(job.holder, [d.id for d in devices if d not in job.devices])
            answer(job.trial_dir, request_id, "rejected", f"trial {job.trial.id} stays on {', '.join(job.device_ids)}: {refused.reason}")
            return f"trial {job.trial.id}: resize to {len(devices)} device(s) refused on its node ({refused.reason})"
        state = read_agent_state(control)
        if state is None or state.seq < seq or not devices:
            return None  # not applied yet (a preemption ends with the task)
        job.awaiting = None
        landed = resize_landed(state, seq, devices)
        if state.status == "finished" and not landed:
            # The agent took the command but training ended before the resize landed: the
            # trial never ran on the new devices, so say so, and give back what a grow took.
            # (Finished on the new devices, it did land: a short rest of training can end
            # before the campaign reads the agent's "running".)
            store.release_devices(job.holder, [d.id for d in devices if d not in job.devices])
            answer(job.trial_dir, request_id, "finished", f"trial {job.trial.id} finished on {', '.join(job.device_ids)} before the resize could happen")
            return f"trial {job.trial.id} finished before its resize to {len(devices)} device(s)"
        if state.status not in ("running", "finished"):
            # The agent failed (or was preempted) at the command: nothing runs on the new devices.
            # Its task records how it ended and gives the rest back; a grow's are given back now.
            store.release_devices(job.holder, [d.id for d in devices if d not in job.devices])
            answer(job.trial_dir, request_id, "rejected", f"trial {job.trial.id}'s agent {state.status} before the resize landed")
            return f"trial {job.trial.id}: its agent {state.status} before its resize to {len(devices)} device(s)"
        left = [d.id for d in job.devices if d not in devices]
        job.devices = devices
        store.release_devices(job.holder, left)
        answer(job.trial_dir, request_id, "applied", f"now on {', '.join(job.device_ids)}")
        return f"trial {job.trial.id} resized to {len(devices)} device(s): {', '.join(job.device_ids)}"

    if job.agent_node is not None and (line := adopt_agent_shrink(job, store)):
        return line
    request = pending_request(job.trial_dir, job.handled)
    if request is None:
        return None
    job.handled.add(request.id)
    by_person = request.by == "person"
    target, low, high = request.devices, job.request.min_devices, job.request.max_devices
    if not job.elastic:
        answer(job.trial_dir, request.id, "rejected", f"trial {job.trial.id} has a fixed size of {len(job.devices)} device(s): declare resources.devices as [min, max] to resize it")
        return None
    if target != 0 and not low <= target <= high:
        answer(job.trial_dir, request.id, "rejected", f"trial {job.trial.id} runs on {low} to {high} devices (0 preempts it); {target} is outside")
        return None
    if by_person:
        job.pinned_by_person = True
    if target == len(job.devices):
        answer(job.trial_dir, request.id, "applied", f"already on {target} device(s)")
        return None
    if target == 0:
        devices: list[Device] = []
    else:
        memory = job.request.at(target).memory_bytes
        spread = recall is not None and job.trial.spec.training.target is None  # a function trial stays on one node
        chosen = resize_devices(inventory, job.device_ids, target, memory, store.usage(), spread=spread)
        if chosen is None:
            where = "in the pool" if spread else f"on {job.devices[0].node}"
            answer(job.trial_dir, request.id, "rejected", f"not enough free devices {where} to grow trial {job.trial.id} to {target}: see `campaign cluster`")
            return None
        devices = [inventory.device(d) for d in chosen]
        # Leased at the new size before the agent is told: a grow's new devices, and the memory
        # per device the new size needs on every one (fewer devices take more each: a shrink's
        # kept devices must have it too, or another trial could be packed into it).
        if not store.acquire(job.holder, claims(job, devices), capacity):
            why = (f"devices {', '.join(chosen[len(job.devices):])} were taken by another campaign" if len(devices) > len(job.devices)
                   else f"at {target} device(s) trial {job.trial.id} needs {memory / (1 << 30):.1f} GiB on each, and "
                        f"{', '.join(chosen)} have not that much free (another trial shares them)")
            answer(job.trial_dir, request.id, "rejected", why)
            return None
        grow = new_host_nodes(job, devices)  # None: not in memory (a relaunch, below, if it changes nodes)
        if hosts is not None and grow:
            seq = job.next_seq  # written once the hosts are up (serve_hosting): the relay reads commands in order
            runs = {node: hosts.start(job, node, [d for d in devices if d.node == node], seq) for node in grow}
            if any(run is None for run in runs.values()):
                for run in runs.values():
                    if run is not None:
                        hosts.end(run)
                store.release_devices(job.holder, [d.id for d in devices if d not in job.devices])
                answer(job.trial_dir, request.id, "rejected", f"trial {job.trial.id}'s agent has not said where it listens yet: try again")
                return None
            job.hosting = (seq, devices, request.id, runs, time.time())
            return f"trial {job.trial.id}: to {target} device(s): its hosts on {', '.join(grow)} start, then it grows in memory"
        if recall is not None and (job.spans_nodes or len({d.node for d in devices}) > 1) and grow is None:
            job.relaunch = (devices, request.id)
            if job.spans_nodes and job.agent_node is None:
                recall(job.trial.id)  # torchrun's, across nodes: every rank stops at a checkpoint (its stop file)
            else:
                write_command(control, job.next_seq, [])  # its agent stops it at a checkpoint it writes then
                job.next_seq += 1
            nodes = ", ".join(dict.fromkeys(d.node for d in devices))
            return f"trial {job.trial.id}: to {target} device(s) on {nodes}: it stops and starts again there"
    write_command(control, job.next_seq, agent_devices(job, devices))
    job.awaiting = (job.next_seq, devices, request.id)
    job.next_seq += 1
    return f"trial {job.trial.id}: resize to {target} device(s) requested"
