"""System metrics per trial: the trial's own devices, sampled while it runs, logged under
its MLflow run.

MLflow's own system-metrics monitor samples every GPU of the host (mlflow#13398), which on a
shared node mixes trials. Here each trial's run gets exactly the devices it leases: GPUs by
UUID through NVML (utilization, memory, power), CPU slots by their cores, and the host
memory its processes hold (`system/trial_memory_rss_megabytes`: the launcher and every
process under it). The device names are MLflow's (`system/gpu_0_utilization_percentage`...),
so they show on the run's System metrics tab; `gpu_<i>` is the trial's i-th device (its
rank order), as in MLflow, and the run's `system.devices` tag says which device each index
is (`gpu_0=GPU-8f…, cpu_0=vm/cpu1`), again after every resize.

A run is sampled 1, 3 and 7 s after it starts, then every period: a trial longer than 10 s
has at least three samples whatever the period, and one that ends before its first gets
one as it ends, logged with its run's closing tags (tasks.tracking.close_trial_run): one
store transaction less for each short trial, which matters where trials take less than the
campaign's own handling of them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from contextlib import ExitStack
from typing import Any, Callable, Sequence

from cluster.inventory import nvml_session
from cluster.types import Device
from tasks.hub_calls import in_hub, in_hub_unanswered

log = logging.getLogger(__name__)

# One sample of a run, as it travels to the hub (JSON): {"values": {name: value},
# "timestamp_ms": int, "step": int, "devices_tag": str | None}.
Reading = dict[str, Any]

RAMP_S = (1.0, 2.0, 4.0)  # gaps before a run's first samples (then its period): 1, 3 and 7 s after it starts
DEVICES_TAG = "system.devices"


def devices_tag(devices: Sequence[Device]) -> str:
    """Which device each metric index is: `gpu_0=<uuid>, cpu_0=<node>/cpu1`."""
    gpus = [d for d in devices if d.kind == "gpu"]
    cpus = [d for d in devices if d.kind == "cpu"]
    return ", ".join([f"gpu_{i}={d.id}" for i, d in enumerate(gpus)] + [f"cpu_{i}={d.id}" for i, d in enumerate(cpus)])


def gpu_readings(nvml: Any, device: Device, index: int) -> dict[str, float]:
    """One GPU's readings under MLflow's names; a reading NVML refuses (MIG, some vGPUs) is left out."""
    handle = nvml.nvmlDeviceGetHandleByUUID(device.id)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    out = {f"gpu_{index}_memory_usage_megabytes": memory.used / 2**20,
           f"gpu_{index}_memory_usage_percentage": 100.0 * memory.used / memory.total}
    for name, read in ((f"gpu_{index}_utilization_percentage", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                       (f"gpu_{index}_power_usage_watts", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)):
        try:
            out[name] = float(read())
        except nvml.NVMLError:
            pass
    return out


def cpu_readings(devices: Sequence[Device], per_core: Sequence[float]) -> dict[str, float]:
    """CPU slots: the utilization of the trial's cores (their mean, and each)."""
    cores = [d.index for d in devices if 0 <= d.index < len(per_core)]
    if not cores:
        return {}
    out = {f"cpu_{i}_utilization_percentage": float(per_core[core]) for i, core in enumerate(cores)}
    out["cpu_utilization_percentage"] = sum(per_core[c] for c in cores) / len(cores)
    return out


def tree_rss_bytes(roots: Sequence[int]) -> int:
    """Resident memory of these processes and all their descendants (gone ones count 0)."""
    import psutil

    seen: dict[int, int] = {}
    for pid in roots:
        try:
            root = psutil.Process(pid)
            family = [root] + root.children(recursive=True)
        except psutil.Error:
            continue
        for proc in family:
            try:
                seen[proc.pid] = proc.memory_info().rss
            except psutil.Error:
                pass
    return sum(seen.values())


def trial_readings(devices: Sequence[Device], nvml: Any | None, per_core: Sequence[float]) -> dict[str, float]:
    """Everything sampled for one trial, `system/`-prefixed as MLflow names system metrics."""
    readings: dict[str, float] = {}
    gpus = [d for d in devices if d.kind == "gpu"]
    if gpus and nvml is not None:
        for i, device in enumerate(gpus):
            try:
                readings.update(gpu_readings(nvml, device, i))
            except nvml.NVMLError as e:  # a lost GPU: the other devices are still worth logging
                log.warning("system metrics: NVML cannot read %s (%s)", device.id, e)
    readings.update(cpu_readings([d for d in devices if d.kind == "cpu"], per_core))
    return {f"system/{k}": v for k, v in readings.items()}


class SystemSampler:
    """Samples every watched trial each `period_s` and logs to its MLflow run, in a thread.

    `nvml` is pynvml (or a fake); `cpu_percent` is psutil.cpu_percent(percpu=True)'s shape,
    the utilization of each core since the previous call.
    """

    def __init__(self, uri: str, period_s: float, nvml: Any | None = None,
                 cpu_percent: Callable[[], Sequence[float]] | None = None,
                 processes_of: Callable[[str], Sequence[int]] | None = None, clock: Callable[[], float] = time.monotonic):
        """processes_of(trial_id): the pids its processes hang from (tasks.trial.trial_process_groups)."""
        import psutil

        self.uri, self.period_s = uri, period_s
        self.cpu_percent = cpu_percent or (lambda: psutil.cpu_percent(percpu=True))
        self.cpu_percent()  # the first call only starts psutil's interval
        self._nvml = ExitStack()  # NVML stays initialised for the sampler's life (None: no NVML, CPU slots)
        self.nvml = self._nvml.enter_context(nvml_session(nvml))
        self.processes_of = processes_of
        self.watched: dict[str, tuple[Device, ...]] = {}  # MLflow run id -> the trial's devices now
        self.trials: dict[str, str] = {}  # MLflow run id -> trial id
        self.samples: dict[str, int] = {}
        self.due: dict[str, float] = {}  # MLflow run id -> when its next sample is due (clock)
        self.tags: dict[str, str] = {}  # MLflow run id -> its devices tag, not yet logged
        self.clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="system-metrics", daemon=True)
        self._thread.start()

    def watch(self, run_id: str, devices: Sequence[Device], trial_id: str | None = None) -> None:
        """Sample these devices (and the trial's processes) for this run from now on (again
        after a resize: the new set)."""
        with self._lock:
            if run_id not in self.watched:
                self.due[run_id] = self.clock() + self._gap(self.samples.get(run_id, 0))
            self.watched[run_id] = tuple(devices)
            self.tags[run_id] = devices_tag(devices)
            if trial_id is not None:
                self.trials[run_id] = trial_id

    def _gap(self, taken: int) -> float:
        return min(self.period_s, RAMP_S[taken]) if taken < len(RAMP_S) else self.period_s

    def forget(self, run_id: str) -> Reading | None:
        """The trial has stopped: no more samples. A trial shorter than a period gets one
        now, so that every run has its devices' readings: returned, for the caller to log
        with what else it writes to the run (`log_reading` logs it alone)."""
        last = None
        if run_id in self.watched and not self.samples.get(run_id):
            try:
                last = self.reading(run_id, self.sample(only=run_id).get(run_id, {}), time.time())
            except Exception as e:  # psutil could not read it: the run goes without, the campaign goes on
                log.warning("system metrics of run %s could not be sampled: %s: %s", run_id, e.__class__.__name__, e)
        with self._lock:
            self.watched.pop(run_id, None)
            self.trials.pop(run_id, None)
            self.due.pop(run_id, None)
        return last

    def sample(self, only: str | Sequence[str] | None = None) -> dict[str, dict[str, float]]:
        """Readings of every watched run (or of the run or runs `only`)."""
        per_core = self.cpu_percent()
        chosen = None if only is None else {only} if isinstance(only, str) else set(only)
        with self._lock:
            watched = {r: d for r, d in self.watched.items() if chosen is None or r in chosen}
            trials = {r: t for r, t in self.trials.items() if r in watched}
        out = {run_id: trial_readings(devices, self.nvml, per_core) for run_id, devices in watched.items()}
        if self.processes_of is not None:
            for run_id, trial_id in trials.items():
                if run_id in out and (rss := tree_rss_bytes(self.processes_of(trial_id))):
                    out[run_id]["system/trial_memory_rss_megabytes"] = rss / 2**20
        return out

    def reading(self, run_id: str, values: dict[str, float], now: float) -> Reading | None:
        """One sample of the run, counted (its step) and with its devices tag if not logged yet."""
        if not values:
            return None
        step = self.samples.get(run_id, 0)
        self.samples[run_id] = step + 1
        with self._lock:
            tag = self.tags.pop(run_id, None)
        return {"values": values, "timestamp_ms": int(now * 1000), "step": step, "devices_tag": tag}

    def log(self, readings: dict[str, dict[str, float]], now: float) -> None:
        for run_id, values in readings.items():
            self.log_reading(run_id, self.reading(run_id, values, now))

    def log_reading(self, run_id: str, reading: Reading | None) -> None:
        if reading is not None:
            log_readings(self.uri, run_id, reading)

    def due_runs(self) -> list[str]:
        """The runs whose next sample is due now; each gets its next due time."""
        now = self.clock()
        with self._lock:
            due = [r for r, t in self.due.items() if t <= now]
            for run_id in due:
                self.due[run_id] = now + self._gap(self.samples.get(run_id, 0) + 1)
        return due

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(min(self.period_s, RAMP_S[0]) / 2):
            try:
                if due := self.due_runs():
                    self.log(self.sample(only=due), time.time())
                failures = 0
            except Exception as e:  # a locked store: the next sample tries again; never the campaign's end
                failures += 1
                if failures in (1, 10, 100):
                    log.warning("system metrics could not be logged (%d in a row): %s: %s", failures, e.__class__.__name__, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._nvml.close()


def reading_batch(reading: Reading) -> tuple[list, list]:
    """A sample's (metrics, tags) for MLflow's `log_batch`: its readings, and its devices tag
    when it changed."""
    from mlflow.entities import Metric, RunTag

    metrics = [Metric(k, v, reading["timestamp_ms"], reading["step"]) for k, v in sorted(reading["values"].items())]
    return metrics, [RunTag(DEVICES_TAG, reading["devices_tag"])] if reading["devices_tag"] else []


@in_hub_unanswered
def log_readings(uri: str, run_id: str, reading: Reading) -> None:
    """One sample of a run's readings (and its devices tag, when it changed), in one
    `log_batch`: in the campaign's hub when it has one (tasks/hub_calls.py)."""
    metrics, tags = reading_batch(reading)
    _client_log_batch(uri)(run_id, metrics=metrics, tags=tags)


@functools.lru_cache(maxsize=None)
def _client_log_batch(uri: str) -> Callable:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri).log_batch
