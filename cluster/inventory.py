"""Which devices this node has and how they connect: NVML, CPU slots, or a declaration.

All of the hardware I/O of cluster/ sits here (with leases.py) so that packing and the
policy only ever see the plain `Inventory` from cluster/types.py. NVML is reached through
a module object (the real `pynvml` by default) so tests can pass a fake with the same
functions; no GPU is needed to test this file.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from cluster.types import Device, Inventory, Link
from training.errors import CampaignError

log = logging.getLogger(__name__)

# NVML's nvmlGpuTopologyLevel_t -> our Link. NODE is "same NUMA node, several host
# bridges": still one socket, so it is PCIE_HOST; only SYSTEM crosses the socket link.
_TOPOLOGY_LINK = {
    0: Link.PCIE_SWITCH,  # NVML_TOPOLOGY_INTERNAL: two GPUs on one board
    10: Link.PCIE_SWITCH,  # NVML_TOPOLOGY_SINGLE
    20: Link.PCIE_SWITCH,  # NVML_TOPOLOGY_MULTIPLE
    30: Link.PCIE_HOST,  # NVML_TOPOLOGY_HOSTBRIDGE
    40: Link.PCIE_HOST,  # NVML_TOPOLOGY_NODE
    50: Link.CROSS_SOCKET,  # NVML_TOPOLOGY_SYSTEM
}
_NVLINK_MAX_LINKS = 18  # per GPU on current parts; pynvml's constant is used when present


class InventoryError(CampaignError):
    """The declared or discovered inventory cannot be used as it stands."""


@dataclass(frozen=True, slots=True)
class DeclaredNode:
    """One node of a declared cluster: `devices` identical devices of `memory_bytes` each.

    `nvlink_pairs` lists local device indices joined by NVLink; other pairs on the node are
    taken to share the host (PCIE_HOST).
    """

    name: str
    devices: int
    memory_bytes: int
    kind: str = "gpu"
    model: str = ""
    nvlink_pairs: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """What a device is doing right now, as NVML sees it (all processes, not only ours)."""

    device_id: str
    free_bytes: int
    used_bytes: int
    utilization_pct: int | None  # GPU busy time over NVML's last sample period


def discover(
    nvml: ModuleType | Any | None = None, cpu_slots: int | None = None, node: str | None = None
) -> Inventory:
    """This node's GPUs from NVML, or `cpu_slots` CPU slots where NVML has none to give."""
    node = node or socket.gethostname()
    with nvml_session(nvml) as lib:
        if lib is not None:
            inventory = _gpu_inventory(lib, node)
            if inventory.devices:
                return inventory
            log.info("NVML reports no usable GPU on %s; using CPU slots", node)
    return _cpu_inventory(node, cpu_slots)


def device_usage(nvml: ModuleType | Any | None = None) -> dict[str, DeviceUsage]:
    """Live free memory and utilization of every GPU, by device id; empty without NVML."""
    usage: dict[str, DeviceUsage] = {}
    with nvml_session(nvml) as lib:
        if lib is None:
            return usage
        for index in range(lib.nvmlDeviceGetCount()):
            try:
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(lib.nvmlDeviceGetUUID(handle))
                memory = lib.nvmlDeviceGetMemoryInfo(handle)
            except lib.NVMLError as e:
                warnings.warn(f"GPU {index}: NVML cannot read it ({e}); left out of usage", stacklevel=2)
                continue
            usage[uuid] = DeviceUsage(uuid, int(memory.free), int(memory.used), _utilization(lib, handle))
    return usage


def declared_inventory(nodes: Sequence[DeclaredNode]) -> Inventory:
    """The inventory a user declared: for planning, or for nodes this process cannot see."""
    if not nodes:
        raise InventoryError("the declared cluster has no node: declare at least one under cluster.nodes")
    seen: set[str] = set()
    devices: list[Device] = []
    links: dict[frozenset[str], Link] = {}
    for spec in nodes:
        _check_declared(spec, seen)
        seen.add(spec.name)
        ids = [f"{spec.name}/{spec.kind}{i}" for i in range(spec.devices)]
        name = spec.model or ("GPU" if spec.kind == "gpu" else "CPU slot")
        devices += [
            Device(ids[i], spec.name, i, spec.kind, name, spec.memory_bytes) for i in range(spec.devices)
        ]
        links.update({frozenset((ids[a], ids[b])): Link.NVLINK for a, b in spec.nvlink_pairs})
    return Inventory(tuple(devices), links)


def visible_devices_env(devices: Sequence[Device]) -> dict[str, str]:
    """The env that makes one node's processes of a trial see only `devices`, in rank order.

    GPUs are named by UUID where known, so the mapping survives CUDA's own ordering; CPU
    slots hide every GPU and list the cores the trainer pins rank i to (the i-th entry).
    """
    if not devices:
        raise ValueError("visible_devices_env needs at least one device")
    if len({d.node for d in devices}) > 1 or len({d.kind for d in devices}) > 1:
        raise ValueError(f"one env per node and kind; got {[d.id for d in devices]}")
    if devices[0].kind == "gpu":
        names = [d.id if d.id.startswith(("GPU-", "MIG-")) else str(d.index) for d in devices]
        return {"CUDA_VISIBLE_DEVICES": ",".join(names)}
    return {"CUDA_VISIBLE_DEVICES": "", "CAMPAIGN_CPU_CORES": ",".join(str(d.index) for d in devices)}


# --- NVML -------------------------------------------------------------------------------


@contextmanager
def nvml_session(nvml: ModuleType | Any | None) -> Iterator[Any | None]:
    """Yields an initialised NVML module, or None where there is no NVML to talk to."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            yield None
            return
    try:
        nvml.nvmlInit()
    except (nvml.NVMLError, OSError) as e:
        log.info("NVML unavailable (%s); falling back to CPU slots", e)
        yield None
        return
    try:
        yield nvml
    finally:
        nvml.nvmlShutdown()


def _gpu_inventory(nvml: Any, node: str) -> Inventory:
    devices: list[Device] = []
    handles: list[Any] = []
    for index in range(nvml.nvmlDeviceGetCount()):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            name = _text(nvml.nvmlDeviceGetName(handle))
            total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        except nvml.NVMLError as e:
            # A lost or locked GPU should not stop a campaign on the others: it is left
            # out, and UUID-based CUDA_VISIBLE_DEVICES keeps the rest correctly named.
            warnings.warn(f"GPU {index} on {node}: NVML cannot read it ({e}); it is left out", stacklevel=3)
            continue
        devices.append(Device(uuid, node, index, "gpu", name, total))
        handles.append(handle)
    return Inventory(tuple(devices), _gpu_links(nvml, devices, handles))


def _gpu_links(nvml: Any, devices: list[Device], handles: list[Any]) -> dict[frozenset[str], Link]:
    buses = [_own_bus_id(nvml, h) for h in handles]
    peers = [_nvlink_peers(nvml, h) for h in handles]
    links: dict[frozenset[str], Link] = {}
    for i in range(len(devices)):
        for j in range(i + 1, len(devices)):
            (bus_i, switch_i), (bus_j, switch_j) = peers[i], peers[j]
            # Behind an NVSwitch every GPU with an active link reaches every other one.
            if buses[j] in bus_i or buses[i] in bus_j or (switch_i and switch_j):
                link = Link.NVLINK
            else:
                link = _pcie_link(nvml, handles[i], handles[j])
            links[frozenset((devices[i].id, devices[j].id))] = link
    return links


def _nvlink_peers(nvml: Any, handle: Any) -> tuple[set[Any], bool]:
    """PCI bus ids at the far end of each active NVLink, and whether one is an NVSwitch."""
    buses: set[Any] = set()
    on_switch = False
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", _NVLINK_MAX_LINKS)):
        try:
            if not nvml.nvmlDeviceGetNvLinkState(handle, link):
                continue
            remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        except nvml.NVMLError:
            continue  # no such link on this part, or no NVLink at all
        try:
            kind = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
        except nvml.NVMLError:
            kind = None  # older drivers: fall back to matching bus ids
        if kind == getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2):
            on_switch = True
        else:
            buses.add(_bus_id(remote.busId))
    return buses, on_switch


def _own_bus_id(nvml: Any, handle: Any) -> tuple[int, ...] | str | None:
    try:
        return _bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
    except nvml.NVMLError:
        return None  # then no NVLink peer can be matched to it by bus id


def _pcie_link(nvml: Any, a: Any, b: Any) -> Link:
    try:
        level = nvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
    except nvml.NVMLError:
        return Link.CROSS_SOCKET  # unknown: assume the worst so packing does not favour it
    return _TOPOLOGY_LINK.get(int(level), Link.CROSS_SOCKET)


def _utilization(nvml: Any, handle: Any) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except nvml.NVMLError:
        return None  # MIG instances and some vGPUs do not report it


def _bus_id(raw: bytes | str) -> tuple[int, ...] | str:
    """'00000000:07:00.0' and '0000:07:00.0' name the same device: compare as numbers."""
    text = _text(raw).strip().lower()
    try:
        domain, bus, rest = text.split(":")
        device, function = rest.split(".")
        return tuple(int(part, 16) for part in (domain, bus, device, function))
    except ValueError:
        return text


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- CPU slots --------------------------------------------------------------------------


HOST_CORES_ENV = "CAMPAIGN_HOST_CORES"  # the cores this host's slots are drawn from, once the orchestrator moved off them


def host_cores() -> list[int]:
    """The cores CPU slots are drawn from: this process's allowed cores, as they were before
    `keep_off_cores` narrowed them (it records them in the environment, for the children too)."""
    recorded = os.environ.get(HOST_CORES_ENV, "")
    if recorded:
        return [int(c) for c in recorded.split(",")]
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _cpu_inventory(node: str, slots: int | None) -> Inventory:
    from training.spec import MAX_SLOTS

    cores = host_cores()
    count = len(cores) if slots is None else slots
    if count < 1:
        raise InventoryError(f"cpu_slots={slots} on {node}: a node needs at least one CPU slot")
    if slots is not None and count > MAX_SLOTS:  # `campaign cluster/worker --cpu-slots` come here unchecked by the spec
        raise InventoryError(f"cpu_slots={slots} on {node}: at most {MAX_SLOTS} CPU slots per node (more than the "
                             f"{len(cores)} cores share them round-robin); give a number in [1, {MAX_SLOTS}]")
    # A core's share of the host's memory, whatever the number of slots: slots of one host are
    # alike however many each node of a pool on it declares.
    memory = _host_memory_bytes() // len(cores)
    # More slots than cores is allowed (small DDP tests on a 2-core box): slots then
    # share cores round-robin, which is what the pinning in the trainer will do.
    devices = tuple(
        Device(
            f"{node}/cpu{i}", node, cores[i % len(cores)], "cpu", f"CPU core {cores[i % len(cores)]}", memory
        )
        for i in range(count)
    )
    # Only pairs on two sockets are links: grouped by socket first, a one-socket host makes
    # none, where comparing every pair of slots took quadratic time (a million slots: hours).
    socket_of = {core: _cpu_socket(core) for core in cores}
    by_socket: dict[int, list[Device]] = {}
    for d in devices:
        by_socket.setdefault(socket_of[d.index], []).append(d)
    groups = list(by_socket.values())
    links = {
        frozenset((a.id, b.id)): Link.CROSS_SOCKET
        for i, group in enumerate(groups)
        for other in groups[i + 1 :]
        for a in group
        for b in other
    }
    return Inventory(devices, links)


def _cpu_socket(core: int) -> int:
    try:
        return int(Path(f"/sys/devices/system/cpu/cpu{core}/topology/physical_package_id").read_text())
    except (OSError, ValueError):
        return 0


def _host_memory_bytes() -> int:
    """Physical RAM, or the cgroup's limit where a container is given less."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        return min(physical, int(limit)) if limit.isdigit() else physical
    except OSError:
        return physical


# --- declared ---------------------------------------------------------------------------


def _check_declared(spec: DeclaredNode, seen: set[str]) -> None:
    where = f"cluster node {spec.name!r}"
    if not spec.name or "/" in spec.name or spec.name != spec.name.strip():
        raise InventoryError(f"{where}: a node name must be non-empty, without '/' or surrounding spaces")
    if spec.name in seen:
        raise InventoryError(f"{where} is declared twice: give each node a unique name")
    if spec.kind not in ("gpu", "cpu"):
        raise InventoryError(f"{where}: kind {spec.kind!r} is not 'gpu' or 'cpu'")
    if spec.devices < 1:
        raise InventoryError(f"{where}: devices={spec.devices}; a node needs at least one device")
    if spec.memory_bytes <= 0:
        raise InventoryError(f"{where}: memory_bytes={spec.memory_bytes}; give each device's memory (> 0)")
    for pair in spec.nvlink_pairs:
        a, b = pair
        if spec.kind != "gpu":
            raise InventoryError(f"{where}: nvlink_pairs only apply to GPUs, not {spec.kind!r} devices")
        if not (0 <= a < spec.devices and 0 <= b < spec.devices) or a == b:
            raise InventoryError(
                f"{where}: nvlink pair {pair} must name two different devices in 0..{spec.devices - 1}"
            )


def spare_cores(inventory: Inventory) -> set[int]:
    """This host's cores that no CPU slot of `inventory` trains on: where the orchestrator
    (the flow, Prefect's server, the MLflow sinks) belongs, off the trials' cores. Empty when
    every core is a slot, or the devices are GPUs (their trials are not pinned)."""
    if not hasattr(os, "sched_getaffinity") or inventory.kind != "cpu":
        return set()
    here = {d.index for d in inventory.devices if d.kind == "cpu"}
    return set(host_cores()) - here


def keep_off_cores(cores: set[int]) -> None:
    """Run every thread of this process (and what it starts from now on) on `cores` only; a
    trial's processes pin themselves to their slot's core when they start."""
    if not cores:
        return
    os.environ.setdefault(HOST_CORES_ENV, ",".join(map(str, host_cores())))  # the slots' view stays the host's
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:  # a thread that ended meanwhile
            pass
