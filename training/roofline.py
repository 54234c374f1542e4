"""A device's roofline: peak compute and memory bandwidth, measured, and the plot of a profile.

The peaks come from a short probe (a large float32 matrix multiply, a large copy) on the
device itself, because data sheets describe neither a CPU slot nor a throttled or shared
GPU. On a GPU the probe also reads what NVML reports (clocks, memory bus width), from
which a theoretical memory bandwidth follows; the plot shows it beside the measured one.

The plot is drawn with matplotlib's object API on an Agg canvas, so importing this module
changes no global backend state.
"""

from __future__ import annotations

import math
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from training.errors import CampaignError

if TYPE_CHECKING:
    from training.profiler import ModelProfile


class DeviceUnavailableError(CampaignError):
    """The device to profile on does not exist here or stopped answering."""


@dataclass(frozen=True, slots=True)
class NvmlInfo:
    """What NVML says about a GPU; the theoretical figures are derived from it."""

    name: str
    memory_total_bytes: int
    max_sm_clock_mhz: int
    max_memory_clock_mhz: int
    memory_bus_width_bits: int

    @property
    def theoretical_bytes_per_s(self) -> float:
        # Double data rate: two transfers per memory clock on each line of the bus.
        return self.max_memory_clock_mhz * 1e6 * 2 * self.memory_bus_width_bits / 8


@dataclass(frozen=True, slots=True)
class DevicePeaks:
    """Measured peaks of one device (a CPU slot of `threads` cores, or a GPU)."""

    device: str  # "cpu" or "cuda:<index>"
    name: str
    peak_flops: float  # float32 FLOP/s of the best matrix multiply
    peak_bytes_per_s: float  # bytes read plus written per second by the best large copy
    threads: int  # intra-op threads the probe ran with (CPU); 0 on a GPU
    nvml: NvmlInfo | None = None

    @property
    def ridge_intensity(self) -> float:
        """FLOP per byte above which a kernel is compute-bound on this device."""
        return self.peak_flops / self.peak_bytes_per_s

    def bound(self, intensity: float) -> str:
        return "compute" if intensity >= self.ridge_intensity else "memory"

    def attainable_flops(self, intensity: float) -> float:
        return min(self.peak_flops, intensity * self.peak_bytes_per_s)

    def to_dict(self) -> dict:
        return {
            "device": self.device, "name": self.name, "peak_flops": self.peak_flops,
            "peak_bytes_per_s": self.peak_bytes_per_s, "threads": self.threads,
            "nvml": None if self.nvml is None else {f: getattr(self.nvml, f) for f in NvmlInfo.__slots__},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "DevicePeaks":
        nvml = NvmlInfo(**d["nvml"]) if d.get("nvml") else None
        return cls(d["device"], d["name"], d["peak_flops"], d["peak_bytes_per_s"], d["threads"], nvml)


# --- device checks and the probe ------------------------------------------------------------

def check_device(device: torch.device) -> torch.device:
    """The device, if this process can use it; else a DeviceUnavailableError naming it."""
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceUnavailableError(f"cannot profile on device {device}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(f"device {device} is not available: this process sees no CUDA GPU (check CUDA_VISIBLE_DEVICES and the driver)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise DeviceUnavailableError(
            f"device {device} is not available: this process sees {torch.cuda.device_count()} GPU(s), cuda:0..cuda:{torch.cuda.device_count() - 1}"
        )
    return torch.device("cuda", index)


def is_device_failure(exc: BaseException) -> bool:
    """True for the errors a GPU gives when it falls off the bus or its context is lost."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and not is_out_of_memory(exc) and ("CUDA error" in text or "CUDA driver" in text or "no CUDA GPUs" in text)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


@contextmanager
def cpu_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` intra-op threads (None: leave as is), then restore."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls after one warm-up: peaks are best cases."""
    fn()
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


# Probe sizes: large enough to leave the caches (a 64 MiB copy moves 128 MiB, beyond any
# CPU's last-level cache share) and reach steady state, small enough to keep the probe
# short (about 0.2 s on one CPU core, less on a GPU).
_MATMUL_N = {"cpu": 1024, "cuda": 8192}
_COPY_BYTES = {"cpu": 64 * 2**20, "cuda": 2 * 2**30}


# matmul_peak's sizes: a trainer measures the peak once at its start, on a device other trials
# may share, so the probe stays small (96 MiB of bf16 on a GPU) and each timing spans 8 calls.
_PEAK_N = {"cpu": 512, "cuda": 4096}
_PEAK_CALLS = 8


def matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, repeats: int = 3) -> float:
    """FLOP/s of the best square matrix multiply in `dtype` on `device`: the peak a trainer's
    model FLOPs utilisation is held against (training.flops), at the dtype its autocast uses."""
    n = _PEAK_N[device.type]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def calls() -> None:
        for _ in range(_PEAK_CALLS):
            torch.mm(a, b, out=out)

    return 2 * n**3 * _PEAK_CALLS / _best_seconds(calls, device, repeats)


def probe_device(device: torch.device, threads: int | None = 1, repeats: int = 3) -> DevicePeaks:
    """Measure the device's peak float32 FLOP/s and copy bandwidth (and read NVML on a GPU).

    On CPU the probe runs with `threads` intra-op threads (default 1: one CPU slot of
    the cluster is one core), the same count `profile_model` uses, so the two agree.
    """
    device = check_device(device)
    n, copy_bytes = _MATMUL_N[device.type], _COPY_BYTES[device.type]
    try:
        with cpu_threads(threads if device.type == "cpu" else None):
            a = torch.randn(n, n, device=device)
            b = torch.randn(n, n, device=device)
            out = torch.empty(n, n, device=device)
            matmul_s = _best_seconds(lambda: torch.mm(a, b, out=out), device, repeats)
            del a, b, out
            src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
            dst = torch.empty_like(src)
            copy_s = _best_seconds(lambda: dst.copy_(src), device, repeats)
            del src, dst
            used_threads = torch.get_num_threads() if device.type == "cpu" else 0
    except RuntimeError as exc:
        if is_device_failure(exc):
            raise DeviceUnavailableError(f"device {device} failed during the roofline probe: {exc}") from exc
        if is_out_of_memory(exc):
            raise DeviceUnavailableError(f"device {device} has too little free memory for the roofline probe ({copy_bytes * 2 / 2**30:.1f} GiB): free it or probe another device") from exc
        raise
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        nvml = read_nvml(device.index, _cuda_uuid(device))
    else:
        name, nvml = _cpu_name(), None
    return DevicePeaks(str(device), name, 2 * n**3 / matmul_s, 2 * copy_bytes / copy_s, used_threads, nvml)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _cuda_uuid(device: torch.device) -> str | None:
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else None


def read_nvml(index: int, uuid: str | None = None) -> NvmlInfo | None:
    """NVML's view of a GPU (by UUID where known, since CUDA_VISIBLE_DEVICES renumbers);
    None when NVML is missing or refuses: the measured peaks stand on their own."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        return NvmlInfo(
            name=name.decode() if isinstance(name, bytes) else str(name),
            memory_total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
            max_sm_clock_mhz=int(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            max_memory_clock_mhz=int(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)),
            memory_bus_width_bits=int(pynvml.nvmlDeviceGetMemoryBusWidth(handle)),
        )
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


# --- the plot -------------------------------------------------------------------------------

def _rate(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def plot_roofline(profile: "ModelProfile", peaks: DevicePeaks, path: str | Path) -> Path:
    """Draw every layer of `profile` against the device's roofline; write a PNG at `path`.

    x: arithmetic intensity (FLOP per byte moved, forward and backward); y: the FLOP/s the
    layer reached in its measured time. Colour says compute- or memory-bound, marker area
    the layer's share of the step. Layers without counted FLOPs (activations, pooling,
    reshapes) have no place on a log axis and are listed under the plot instead.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(9, 6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    plotted = [l for l in profile.layers if l.flops > 0 and l.time_s > 0]
    off_plot = [l for l in profile.layers if l not in plotted]

    intensities = [l.arithmetic_intensity for l in plotted] + [peaks.ridge_intensity]
    x_lo, x_hi = min(intensities) / 10, max(intensities) * 10
    xs = [x_lo * (x_hi / x_lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [peaks.attainable_flops(x) for x in xs], color="black", lw=2, label="roofline (measured peaks)")
    ax.axvline(peaks.ridge_intensity, color="grey", ls=":", lw=1)
    ax.annotate(f"ridge {peaks.ridge_intensity:.1f} FLOP/B", (peaks.ridge_intensity, peaks.peak_flops), textcoords="offset points", xytext=(4, -14), fontsize=8, color="grey")
    if peaks.nvml is not None:
        bw = peaks.nvml.theoretical_bytes_per_s
        ax.plot(xs, [min(peaks.peak_flops, x * bw) for x in xs], color="grey", ls="--", lw=1, label=f"NVML memory bandwidth {_rate(bw, 'B/s')}")

    step_s = profile.step.step_s
    for bound, colour in (("compute", "tab:blue"), ("memory", "tab:orange")):
        group = [l for l in plotted if l.bound(peaks) == bound]
        if group:
            ax.scatter(
                [l.arithmetic_intensity for l in group], [l.achieved_flops for l in group],
                s=[30 + 600 * l.share(step_s) for l in group], color=colour, alpha=0.7, edgecolors="black", label=f"{bound}-bound layer",
            )
    for i, l in enumerate(plotted):  # alternate label offsets: twin layers sit on one point
        ax.annotate(f"{l.name} ({l.kind})", (l.arithmetic_intensity, l.achieved_flops), textcoords="offset points", xytext=(6, 4 - 14 * (i % 2)), fontsize=8)

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_lo, x_hi)
    achieved = [l.achieved_flops for l in plotted] or [peaks.peak_flops]
    ax.set_ylim(min(min(achieved), peaks.attainable_flops(x_lo)) / 3, peaks.peak_flops * 3)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(
        f"{profile.model}, batch {profile.batch_size} on {peaks.device} ({peaks.name})\n"
        f"peak {_rate(peaks.peak_flops, 'FLOP/s')}, {_rate(peaks.peak_bytes_per_s, 'B/s')}; marker area = share of step",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    legend = ax.legend(loc="lower right", fontsize=8)
    for handle in legend.legend_handles:  # one marker size in the legend, whatever the shares
        if hasattr(handle, "set_sizes"):
            handle.set_sizes([40])
    if off_plot:
        names = ", ".join(f"{l.name} ({l.kind}, {l.share(step_s):.0%})" for l in off_plot)
        fig.text(0.01, 0.01, f"no counted FLOPs, not plotted: {names}", fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
