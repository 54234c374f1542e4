"""Plain data shared by every part of cluster/: devices, how they connect, requests.

These are frozen dataclasses with no behaviour beyond lookups so that the pure parts
(packing, policy, simulator) can be driven from tests and traces without any hardware.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Protocol


class Link(enum.IntEnum):
    """How two devices talk, best first. Lower is better: packing prefers low links."""

    SAME = 0  # the device itself
    NVLINK = 1
    PCIE_SWITCH = 2  # same PCIe switch (NVML: SINGLE or MULTIPLE)
    PCIE_HOST = 3  # same CPU socket, through the host bridge (NVML: HOSTBRIDGE or NODE)
    CROSS_SOCKET = 4  # across CPU sockets (NVML: SYSTEM; NODE is the same NUMA node)
    NETWORK = 5  # different nodes


@dataclass(frozen=True, slots=True)
class Device:
    """One schedulable device: a GPU, or a CPU slot (one core) where there is no GPU."""

    id: str  # stable and unique across the cluster: the GPU UUID, or "<node>/cpu<index>"
    node: str
    index: int  # local index on its node: CUDA ordinal for GPUs, core number for CPU slots
    kind: str  # "gpu" or "cpu"
    name: str
    memory_bytes: int  # total memory of the device (a CPU slot: its share of host RAM)


@dataclass(frozen=True, slots=True)
class Inventory:
    """Every device of the cluster and the link between each pair on the same node."""

    devices: tuple[Device, ...]
    # Keyed by frozenset({id_a, id_b}); pairs missing on one node default to PCIE_HOST,
    # pairs on different nodes are always NETWORK.
    links: Mapping[frozenset[str], Link] = field(default_factory=dict)

    def device(self, device_id: str) -> Device:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise KeyError(device_id)

    def link(self, a: str, b: str) -> Link:
        if a == b:
            return Link.SAME
        da, db = self.device(a), self.device(b)
        if da.node != db.node:
            return Link.NETWORK
        return self.links.get(frozenset((a, b)), Link.PCIE_HOST)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d.node for d in self.devices))

    @property
    def kind(self) -> str:
        return self.devices[0].kind if self.devices else "cpu"


# The memory per device of a request for whole devices: each device it gets is its own, all
# of its memory, whatever that is. A number would be one device's memory, and a pool whose
# nodes' devices differ would hold such a trial only on the devices of that much. Larger than
# any device: code that compares it as bytes finds it fits nowhere, never on a shared device.
WHOLE_DEVICE = 2**62


def claim_bytes(memory_bytes: int, capacity_bytes: int) -> int:
    """What a request of `memory_bytes` per device takes of a device of `capacity_bytes`."""
    return capacity_bytes if memory_bytes == WHOLE_DEVICE else memory_bytes


@dataclass(frozen=True, slots=True)
class Request:
    """What one trial needs to start: `devices` devices with `memory_bytes` free on each.

    A request whose memory equals a device's whole memory takes the device exclusively;
    a smaller one may share the device with other trials, by memory. `WHOLE_DEVICE` takes
    each device exclusively, whatever its memory.
    """

    trial_id: str
    devices: int
    memory_bytes: int

    @property
    def whole(self) -> bool:
        return self.memory_bytes == WHOLE_DEVICE


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one request landed: one device id per process of the trial (rank order)."""

    trial_id: str
    device_ids: tuple[str, ...]
    memory_bytes: int  # per device, as requested: WHOLE_DEVICE takes each device's capacity (claim_bytes)

    @property
    def shared_bytes(self) -> int | None:
        """The memory per device of a placement that shares its devices by memory; None for whole devices."""
        return None if self.memory_bytes == WHOLE_DEVICE else self.memory_bytes

    def claims(self, capacity: Mapping[str, int]) -> dict[str, int]:
        """The bytes to lease on each device, of its `capacity` (bytes per device id)."""
        return {d: claim_bytes(self.memory_bytes, capacity[d]) for d in self.device_ids}


class StepTimeModel(Protocol):
    """Predicts one training step's time of a job, in seconds, at a size and spread.

    The prior from a per-layer profile and the model refined online from measured step
    times share this interface so that sizing and the policy need not know which they hold.
    """

    def step_time(self, devices: int, nodes: int = 1) -> float: ...
