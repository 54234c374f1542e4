"""Plain data the scheduling policy reads and writes: nodes, jobs and allocations.

The policy sees the cluster as nodes holding devices, and a job's locality only through
the number of nodes it spans (devices on one node talk over NVLink/PCIe, across nodes
over the network): that is the `nodes` argument of `StepTimeModel.step_time`.
An allocation maps a job id to its placement, `{node name: device count}`; a job absent
from it (or mapped to an empty placement) holds no device.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from cluster.types import Inventory, StepTimeModel

Placement = Mapping[str, int]  # node name -> devices of that node
Allocation = Mapping[str, Placement]  # job id -> its placement


class InvalidAllocation(Exception):
    """A policy returned an allocation that breaks an invariant: a bug in the policy.

    Not a CampaignError: no user input can cause it, and it is never silently repaired.
    """


@dataclass(frozen=True, slots=True)
class Node:
    """One machine: its devices, in local index order."""

    name: str
    device_ids: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.device_ids)


@dataclass(frozen=True, slots=True)
class Cluster:
    """Every node the policy may place jobs on."""

    nodes: tuple[Node, ...]
    _by_name: Mapping[str, Node] = field(init=False, repr=False, compare=False)
    # Prefix sums of node sizes, largest first: the fewest nodes that can hold n devices.
    _largest_prefix: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {n.name: n for n in self.nodes}
        if len(by_name) != len(self.nodes):
            raise ValueError("node names must be unique")
        prefix, total = [], 0
        for size in sorted((n.size for n in self.nodes), reverse=True):
            total += size
            prefix.append(total)
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_largest_prefix", tuple(prefix))

    @classmethod
    def uniform(cls, nodes: int, devices_per_node: int, prefix: str = "node") -> Cluster:
        """`nodes` identical nodes named `<prefix><i>` with devices `<node>/gpu<j>`."""
        width = len(str(max(nodes - 1, 0)))
        names = [f"{prefix}{i:0{width}d}" for i in range(nodes)]
        return cls(tuple(Node(n, tuple(f"{n}/gpu{j}" for j in range(devices_per_node))) for n in names))

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> Cluster:
        """The policy's view of a discovered or declared inventory (devices grouped by node)."""
        by_node: dict[str, list[tuple[int, str]]] = {name: [] for name in inventory.nodes}
        for device in inventory.devices:
            by_node[device.node].append((device.index, device.id))
        return cls(tuple(Node(name, tuple(i for _, i in sorted(devs))) for name, devs in by_node.items()))

    @property
    def total(self) -> int:
        return self._largest_prefix[-1] if self._largest_prefix else 0

    @property
    def largest_node(self) -> int:
        return self._largest_prefix[0] if self._largest_prefix else 0

    def node(self, name: str) -> Node:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def min_nodes(self, devices: int) -> int:
        """The fewest nodes that can hold `devices` devices on an empty cluster."""
        if devices <= 0:
            return 0
        if devices > self.total:
            raise ValueError(f"{devices} devices exceed the cluster's {self.total}")
        return bisect.bisect_left(self._largest_prefix, devices) + 1


@dataclass(frozen=True, slots=True)
class Job:
    """What the policy knows of one active (arrived, unfinished) job.

    `attained` is the device-time it has held so far (device-seconds), the basis of
    least-attained-service priority; `since` is when its placement last changed (its
    arrival if it never ran): a waiting job has waited `now - since`, a running one has run
    that long at its current placement. `explored_nodes` is the most nodes it has run on
    long enough to report a step time: its model has seen no wider spread. `preemptions`
    counts the times it was taken off all its devices before finishing, `restarts` every
    stop of its processes (resizes too), `explored_devices` the most devices it ran on.
    `pause_s` is what its last stop and restart cost it in training time, as measured (a
    campaign's trainer times each resize); None until it has restarted once.
    """

    id: str
    arrival: float
    requested: int
    min_devices: int
    max_devices: int
    model: StepTimeModel
    attained: float = 0.0
    placement: Placement = field(default_factory=dict)
    since: float | None = None
    explored_nodes: int = 0
    preemptions: int = 0
    restarts: int = 0  # stops of its processes so far: resizes and preemptions
    explored_devices: int = 0  # the most devices it has run on
    # Reference steps still to run, when known (a trial declares its steps; a cluster job
    # does not): None leaves the policy to guess from attained service.
    remaining_steps: float | None = None
    pause_s: float | None = None  # measured cost of one stop and restart; None: the policy's estimate

    def __post_init__(self) -> None:
        if not 1 <= self.min_devices <= self.max_devices:
            raise ValueError(f"job {self.id}: need 1 <= min_devices <= max_devices")
        if self.since is None:
            object.__setattr__(self, "since", self.arrival)

    @property
    def devices(self) -> int:
        return devices_of(self.placement)

    @property
    def unchanged_since(self) -> float:
        return self.arrival if self.since is None else self.since

    def unchanged_for(self, now: float) -> float:
        """How long it has been waiting (if waiting) or running as it is (if running)."""
        return now - self.unchanged_since

    @property
    def running(self) -> bool:
        return self.devices > 0


def devices_of(placement: Placement | None) -> int:
    return sum(placement.values()) if placement else 0


def nodes_of(placement: Placement | None) -> int:
    return sum(1 for c in placement.values() if c > 0) if placement else 0


def same_placement(a: Placement | None, b: Placement | None) -> bool:
    """Equal as placements: zero counts and missing nodes are the same thing."""
    return {n: c for n, c in (a or {}).items() if c} == {n: c for n, c in (b or {}).items() if c}


def speedup(model: StepTimeModel, devices: int, nodes: int) -> float:
    """Throughput at (`devices`, `nodes`) relative to one device: 0 for no device."""
    if devices <= 0:
        return 0.0
    return model.step_time(1, 1) / model.step_time(devices, nodes)


def validate_allocation(cluster: Cluster, jobs: Iterable[Job], allocation: Allocation) -> None:
    """Raise InvalidAllocation unless `allocation` is a legal decision for `jobs`.

    Legal: only active jobs, every placed job whole (between its min and max devices: gangs
    are all-or-nothing), and the node capacities of `check_capacity`.
    """
    known = {j.id: j for j in jobs}
    for job_id, placement in allocation.items():
        job = known.get(job_id)
        if job is None:
            raise InvalidAllocation(f"allocation names job {job_id!r}, which is not active")
        total = devices_of(placement)
        if total and not job.min_devices <= total <= job.max_devices:
            raise InvalidAllocation(
                f"job {job_id}: {total} devices outside its range "
                f"[{job.min_devices}, {job.max_devices}] (a gang runs whole or not at all)"
            )
    check_capacity(cluster, allocation)


def check_capacity(cluster: Cluster, allocation: Allocation) -> None:
    """Raise InvalidAllocation for an unknown node, a bad count or an over-committed node."""
    used: dict[str, int] = {}
    for job_id, placement in allocation.items():
        for node, count in placement.items():
            if node not in cluster:
                raise InvalidAllocation(f"job {job_id}: unknown node {node!r}")
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise InvalidAllocation(f"job {job_id}: bad device count {count!r} on {node}")
            used[node] = used.get(node, 0) + count
    for node, count in used.items():
        size = cluster.node(node).size
        if count > size:
            holders = sorted(j for j, p in allocation.items() if p.get(node))
            raise InvalidAllocation(
                f"node {node} over-committed: {count} devices placed on its {size} by {holders}"
            )


def bind_devices(
    cluster: Cluster, allocation: Allocation, previous: Mapping[str, Sequence[str]] | None = None
) -> dict[str, tuple[str, ...]]:
    """Which device ids each placed job gets, keeping the ids it already holds where it can.

    `previous` maps a job id to the device ids it holds now. A job keeps its old devices on
    a node up to its new count there, then takes that node's free devices in index order,
    so a job whose placement did not change keeps exactly its devices.
    """
    check_capacity(cluster, allocation)
    previous = previous or {}
    kept: dict[str, dict[str, list[str]]] = {}
    taken: set[str] = set()
    for job_id in sorted(allocation):
        old = [d for d in previous.get(job_id, ()) if d not in taken]
        per_node: dict[str, list[str]] = {}
        for node, count in allocation[job_id].items():
            on_node = set(cluster.node(node).device_ids)
            mine = [d for d in old if d in on_node][:count]
            per_node[node] = mine
            taken.update(mine)
        kept[job_id] = per_node
    bound: dict[str, tuple[str, ...]] = {}
    for job_id in sorted(allocation):
        ids: list[str] = []
        for node, count in sorted(allocation[job_id].items()):
            mine = kept[job_id].get(node, [])
            free = (d for d in cluster.node(node).device_ids if d not in taken)
            extra = [next(free) for _ in range(count - len(mine))]
            taken.update(extra)
            ids.extend(mine + extra)
        bound[job_id] = tuple(ids)
    return bound

