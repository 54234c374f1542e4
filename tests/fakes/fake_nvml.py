"""A module-like stand-in for `pynvml`, describing GPUs that this machine does not have.

It implements the subset of pynvml that cluster/inventory.py calls, with pynvml's own
constants and error classes (taken from the installed module), and it behaves like NVML
where that matters to the caller: calls before nvmlInit fail, nonexistent NVLinks raise,
busIds at the far end of a link use the short PCI domain form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

GiB = 1 << 30
_LINKS_PER_GPU = 18  # NVLink ports NVML reports on an H100
_SWITCH_BUS = "0000:{:02x}:00.0"  # NVSwitches sit on their own buses


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    total_bytes: int = 80 * GiB
    used_bytes: int = 0
    utilization_pct: int | None = 0  # None: NVML answers "not supported" (as MIG does)
    socket: int = 0
    pcie_switch: int | None = None  # GPUs with the same id sit behind one PCIe switch
    lost: bool = False  # every query on it fails with "GPU is lost"
    power_mw: int | None = 300_000  # None: NVML answers "not supported"
    nvlinks: dict[int, str] = field(default_factory=dict)  # link number -> remote busId


@dataclass(frozen=True)
class _Handle:
    index: int


class FakeNvml:
    """pynvml's functions over a described node; counts init/shutdown to check pairing."""

    def __init__(
        self,
        gpus: Sequence[FakeGpu] = (),
        nvlink_pairs: Sequence[tuple[int, int]] = (),
        *,
        nvswitch: bool = False,
        init_error: int | None = None,
    ) -> None:
        self.gpus = list(gpus)
        self.nvswitch = nvswitch
        self.init_error = init_error
        self.active_sessions = 0
        self.sessions_opened = 0
        for a, b in nvlink_pairs:
            self._connect(a, b)
        if nvswitch:
            for gpu in self.gpus:
                gpu.nvlinks.update({link: _SWITCH_BUS.format(0xF0 + link % 4) for link in range(4)})

    def __getattr__(self, name: str) -> Any:
        # Constants and error classes are pynvml's own, so a wrong name fails here too.
        if name.startswith(("NVML_", "NVMLError")):
            return getattr(pynvml, name)
        raise AttributeError(f"the fake NVML does not implement {name}")

    # --- session -------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.active_sessions += 1
        self.sessions_opened += 1

    def nvmlShutdown(self) -> None:
        self._require_init()
        self.active_sessions -= 1

    # --- devices -------------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._require_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._require_init()
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        self._require_init()
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for index, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return _Handle(index)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        gpu = self._gpu(handle)
        if gpu.power_mw is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.power_mw  # milliwatts, as NVML reports

    def nvmlDeviceGetUUID(self, handle: _Handle) -> bytes:
        return self._gpu(handle).uuid.encode()  # real pynvml returns bytes here

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:
        gpu = self._gpu(handle)
        return SimpleNamespace(
            total=gpu.total_bytes, used=gpu.used_bytes, free=gpu.total_bytes - gpu.used_bytes
        )

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:
        gpu = self._gpu(handle)
        if gpu.utilization_pct is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=gpu.utilization_pct, memory=0)

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> SimpleNamespace:
        self._gpu(handle)
        return SimpleNamespace(busId=self._bus(handle.index, long=True).encode())

    # --- topology ------------------------------------------------------------------------
    def nvmlDeviceGetTopologyCommonAncestor(self, a: _Handle, b: _Handle) -> int:
        ga, gb = self._gpu(a), self._gpu(b)
        if a == b:
            return pynvml.NVML_TOPOLOGY_INTERNAL
        if ga.pcie_switch is not None and ga.pcie_switch == gb.pcie_switch:
            return pynvml.NVML_TOPOLOGY_SINGLE
        if ga.socket == gb.socket:
            return pynvml.NVML_TOPOLOGY_HOSTBRIDGE
        return pynvml.NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetNvLinkState(self, handle: _Handle, link: int) -> int:
        gpu = self._gpu(handle)
        if not gpu.nvlinks:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < _LINKS_PER_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if link in gpu.nvlinks else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: _Handle, link: int) -> SimpleNamespace:
        gpu = self._gpu(handle)
        if link not in gpu.nvlinks:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return SimpleNamespace(busId=gpu.nvlinks[link].encode())

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: _Handle, link: int) -> int:
        self.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        if self.nvswitch:
            return pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        return pynvml.NVML_NVLINK_DEVICE_TYPE_GPU

    # --- helpers -------------------------------------------------------------------------
    def _require_init(self) -> None:
        if self.active_sessions <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: _Handle) -> FakeGpu:
        self._require_init()
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    @staticmethod
    def _bus(index: int, long: bool) -> str:
        return f"{'00000000' if long else '0000'}:{0x18 + 0x10 * index:02X}:00.0"

    def _connect(self, a: int, b: int) -> None:
        # Two NVLinks per pair, as bridged pairs of PCIe cards have; numbered per GPU.
        for src, dst in ((a, b), (b, a)):
            links = self.gpus[src].nvlinks
            for _ in range(2):
                links[len(links)] = self._bus(dst, long=False)


def gpu_uuid(node: int, index: int) -> str:
    return f"GPU-{node:08x}-0000-4000-8000-{index:012x}"


def eight_gpu_node(
    node: int, *, nvswitch: bool = False, pcie_switches: Sequence[Sequence[int]] = ()
) -> FakeNvml:
    """8 GPUs, 0-3 on socket 0 and 4-7 on socket 1, NVLink-bridged in pairs (0,1)..(6,7).

    `node` makes UUIDs unique across fake nodes; `pcie_switches` groups GPUs under a
    shared PCIe switch; `nvswitch` replaces the bridges with an NVSwitch fabric.
    """
    switch_of = {gpu: s for s, group in enumerate(pcie_switches) for gpu in group}
    gpus = [FakeGpu(gpu_uuid(node, i), socket=i // 4, pcie_switch=switch_of.get(i)) for i in range(8)]
    pairs = () if nvswitch else ((0, 1), (2, 3), (4, 5), (6, 7))
    return FakeNvml(gpus, pairs, nvswitch=nvswitch)


def no_nvml() -> FakeNvml:
    """A node without the NVIDIA driver: nvmlInit fails as pynvml does there."""
    return FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
