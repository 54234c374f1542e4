"""Profile one trial on leased devices, write what it found, log it to an MLflow run of its own.

    <runs_dir>/<campaign>/<trial_id>/profile/
        profile.md        per-layer table, DDP measurement, predicted step times (markdown)
        roofline.png      every layer against the device's measured roofline
        profile.json      training.profiler.ModelProfile (ModelProfile.from_json reads it)
        peaks.json        training.roofline.DevicePeaks of the device profiled on
        ddp.json, ddp.log DdpProfile at the trial's device count, and torchrun's output (> 1 device)
        predictions.json  the step-time prior (cluster.step_time_prior) at 1..N devices of one node

The per-layer part runs in this process on the first leased device, pinned to its core and
one thread when it is a CPU slot (as the trainer pins a rank); the DDP part is a real
torchrun of training.profile_ddp on all of them, each rank pinned the same way. The
directory is staged aside and swapped in whole, so a reader sees one profile or the other.

A profile is advice, not a result: `profile_trial` turns the profiler's errors (a layer
that cannot run, a batch that does not fit, a device that is gone) into a warning and
None, and the caller goes on without it. A failed DDP part only drops that part.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from mlflow import MlflowClient
from mlflow.entities import RunTag
from prefect import get_run_logger, task

from cluster.inventory import visible_devices_env
from cluster.step_time_prior import ProfileStepTimeModel, StepTimeBreakdown
from cluster.types import Device
from tasks.grid import Trial
from tasks.workload import trial_workload
from tasks.tracking import CAMPAIGN_TAG
from training.errors import CampaignError
from training.files import write_atomic
from training.workload import build_model, build_objective, build_optimizer, datasets, sample_batch
from training.process import die_with_parent
from training.profiler import DdpProfile, ModelProfile, ProfileError, profile_model, to_markdown
from training.roofline import DevicePeaks, DeviceUnavailableError, plot_roofline, probe_device

PROFILE_DIR = "profile"
MLFLOW_ARTIFACT_PATH = "profile"
DDP_TIMEOUT_S = 300.0  # the DDP part takes seconds; a rendezvous or all-reduce that hangs must not hold the devices
LOG_TAIL_CHARS = 2000


class DdpProfileError(ProfileError):
    """The torchrun of the DDP part failed or hung; the message names the devices."""


@dataclass(frozen=True, slots=True)
class ProfileJob:
    """What to profile (the trial's model, batch and optimizer) and where (leased devices)."""

    trial_id: str
    label: str
    workload: dict[str, Any]  # model, data, loss, optimizer: as the trial's config has them (training.workload)
    batch_size: int  # global, as the trial trains
    lr: float
    seed: int
    devices: tuple[Device, ...]  # one per DDP process, rank order; the first also gets the per-layer profile
    out_dir: Path
    predict_up_to: int  # predictions at 1..this many devices
    repeats: int = 20  # timed runs per layer and per step (medians)
    ddp_steps: int = 30


@dataclass(frozen=True, slots=True)
class ProfileResult:
    trial_id: str
    directory: Path
    profile: ModelProfile
    peaks: DevicePeaks
    ddp: DdpProfile | None
    predictions: tuple[StepTimeBreakdown, ...]  # at 1, 2, ... devices of one node
    markdown: str
    ddp_error: str | None = None  # why the DDP part is missing, when it failed
    files: tuple[str, ...] = ()  # names in `directory`


def profile_dir(runs_dir: Path, campaign: str, trial_id: str) -> Path:
    return Path(runs_dir) / campaign / trial_id / PROFILE_DIR


def load_prior(directory: Path) -> ProfileStepTimeModel | None:
    """The step-time prior of a trial profiled before (`campaign profile`), or None if it
    was not (or its files do not read: a prior is advice, never a reason to fail)."""
    from training.files import loads_json, read_bounded

    def text(name: str) -> str:
        return read_bounded(directory / name, 64 << 20).decode()

    try:
        profile = ModelProfile.from_json(text("profile.json"))
        ddp = DdpProfile.from_json(text("ddp.json")) if (directory / "ddp.json").exists() else None
        peaks = loads_json(text("peaks.json"), directory / "peaks.json") if (directory / "peaks.json").exists() else {}
        return ProfileStepTimeModel.from_profile(profile, ddp, memory_bytes_per_s=peaks.get("peak_bytes_per_s"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def profile_job(trial: Trial, devices: Sequence[Device], out_dir: Path, predict_up_to: int, **options: Any) -> ProfileJob:
    t = trial.spec.training
    return ProfileJob(
        trial_id=trial.id, label=trial.label, workload=trial_workload(trial.spec), batch_size=t.batch_size,
        lr=t.lr, seed=trial.spec.seed,
        devices=tuple(devices), out_dir=Path(out_dir), predict_up_to=max(predict_up_to, len(devices)), **options,
    )


# --- the per-layer part, in this process ---------------------------------------------------------

@contextmanager
def pinned(device: Device) -> Iterator[None]:
    """Run the block on the device's core when it is a CPU slot, then restore.

    sched_setaffinity(0) pins the calling thread only: the rest of the process (Prefect's
    threads, the lease heartbeat) keeps its cores."""
    if device.kind != "cpu":
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {device.index})
    except OSError as exc:
        raise DeviceUnavailableError(
            f"CPU slot {device.id} (core {device.index}) is not available to this process ({exc.strerror}); "
            f"it may be offline or outside this process's cpuset: run `campaign cluster` to see the slots"
        ) from exc
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def torch_device(device: Device) -> torch.device:
    """The torch device of a leased Device: a GPU found by UUID (CUDA may order GPUs unlike NVML)."""
    if device.kind == "cpu":
        return torch.device("cpu")
    if device.id.startswith("GPU-") and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"GPU-{torch.cuda.get_device_properties(i).uuid}" == device.id:
                return torch.device("cuda", i)
        raise DeviceUnavailableError(f"GPU {device.id} ({device.name}) is not visible to this process: it may have fallen off the bus, or CUDA_VISIBLE_DEVICES hides it")
    return torch.device("cuda", device.index)  # training.roofline.check_device names it if it is missing


def example_batch(job: ProfileJob) -> tuple[Any, Any]:
    """A batch of the trial's real training samples at its global batch size: time and FLOPs
    depend on the shapes (and, for data-dependent models, on the data itself)."""
    return sample_batch(datasets(job.workload["data"])[0], job.batch_size)


def profile_layers(job: ProfileJob) -> tuple[ModelProfile, DevicePeaks]:
    """The per-layer profile and the roofline probe, on the first device, with the trial's optimizer."""
    device = job.devices[0]
    torch.manual_seed(job.seed)
    model = build_model(job.workload["model"])
    optimizer = lambda params: build_optimizer(job.workload["optimizer"], params, job.lr)  # noqa: E731
    with pinned(device):
        where = torch_device(device)
        peaks = probe_device(where)
        profile = profile_model(model, example_batch(job), build_objective(job.workload["model"], job.workload["loss"]), where, job.repeats, optimizer=optimizer)
    return profile, peaks


# --- the DDP part, under torchrun -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DdpPlan:
    command: list[str]
    env: dict[str, str]  # added to this process's environment
    out: Path
    log: Path


def plan_ddp(job: ProfileJob, directory: Path, python: str = sys.executable) -> DdpPlan:
    """torchrun of training.profile_ddp on the job's devices, one rank per device."""
    out = directory / "ddp.json"
    command = [
        python, "-m", "training.launch", "--standalone", f"--nproc-per-node={len(job.devices)}",
        "-m", "training.profile_ddp", "--workload", json.dumps(job.workload),
        "--batch-size", str(job.batch_size), "--steps", str(job.ddp_steps), "--seed", str(job.seed),
        "--out", str(out),
    ]
    env = {
        **visible_devices_env(job.devices),  # CPU slots: each rank pins itself to its core (training.train.pick_device)
        # gloo picks the first non-loopback interface unless told otherwise, and hangs on it here.
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "MASTER_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    return DdpPlan(command, env, out, directory / "ddp.log")


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except FileNotFoundError:
        return ""


def run_ddp(plan: DdpPlan, devices: Sequence[Device], timeout_s: float = DDP_TIMEOUT_S) -> DdpProfile:
    """Apply the plan; DdpProfileError (naming the devices, with the log's end) if it fails or hangs."""
    where = ", ".join(d.id for d in devices)
    with open(plan.log, "wb") as log:
        proc = subprocess.Popen(
            plan.command, env={**os.environ, **plan.env}, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM),
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except BaseException as exc:
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
            proc.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise DdpProfileError(f"the DDP profile on {where} did not finish within {timeout_s:.0f} s; end of {plan.log.name}:\n{_tail(plan.log)}") from None
            raise
    if code != 0 or not plan.out.is_file():
        raise DdpProfileError(f"the DDP profile on {where} exited with code {code}; end of {plan.log.name}:\n{_tail(plan.log)}")
    return DdpProfile.from_json(plan.out.read_text())


# --- predictions and the markdown ------------------------------------------------------------------

def predict(profile: ModelProfile, peaks: DevicePeaks, ddp: DdpProfile | None, up_to: int) -> tuple[StepTimeBreakdown, ...]:
    prior = ProfileStepTimeModel.from_profile(profile, ddp, memory_bytes_per_s=peaks.peak_bytes_per_s)
    return tuple(prior.breakdown(n) for n in range(1, up_to + 1))


PREDICTION_COLUMNS = ("devices", "batch/device", "step ms", "measured ms", "compute ms", "exposed all-reduce ms", "wait ms", "DDP ms", "samples/s", "speed-up")


def prediction_rows(predictions: Sequence[StepTimeBreakdown], global_batch: int, ddp: DdpProfile | None) -> list[list[str]]:
    """The prior's step time at each size, as text; "measured" is the DDP run, where there is one."""
    base = predictions[0].step_s
    rows = []
    for p in predictions:
        measured = f"{ddp.step_s * 1e3:.3f}" if ddp is not None and ddp.world_size == p.devices else ""
        rows.append([
            str(p.devices), str(p.per_device_batch), f"{p.step_s * 1e3:.3f}", measured,
            f"{(p.forward_s + p.backward_s + p.optimizer_s) * 1e3:.3f}", f"{p.exposed_allreduce_s * 1e3:.3f}",
            f"{p.straggler_s * 1e3:.3f}", f"{p.overhead_s * 1e3:.3f}", f"{global_batch / p.step_s:,.0f}", f"{base / p.step_s:.2f}x",
        ])
    return rows


def prediction_table(title: str, rows: list[list[str]], width: int | None = None) -> "Table":
    """The predictions as a rich table: a row per device count, or, where that is wider than
    `width` (ten columns at 80 would be cut to 'step …'), a row per quantity and a column per
    device count."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in PREDICTION_COLUMNS:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*row)
    if width is None or Console(width=10_000).measure(table).maximum <= width:
        return table
    turned = Table(title=title, title_justify="left")
    turned.add_column(PREDICTION_COLUMNS[0], no_wrap=True)
    for row in rows:
        turned.add_column(row[0], justify="right", no_wrap=True)
    for i, quantity in enumerate(PREDICTION_COLUMNS[1:], start=1):
        turned.add_row(quantity, *(row[i] for row in rows))
    return turned


def render_markdown(job: ProfileJob, profile: ModelProfile, peaks: DevicePeaks, ddp: DdpProfile | None,
                    predictions: Sequence[StepTimeBreakdown], ddp_error: str | None) -> str:
    lines = [f"# Profile of trial {job.trial_id} ({job.label})", "", to_markdown(profile, peaks, ddp).rstrip(), ""]
    if ddp_error is not None:
        lines += [f"The DDP measurement on {len(job.devices)} device(s) failed, so the predictions use the documented link defaults: "
                  f"{ddp_error.splitlines()[0]}", ""]
    elif ddp is None:
        lines += ["One device: no DDP measurement; the predictions use the documented link defaults for this kind of device.", ""]
    lines += [
        "## Predicted step time (cluster.step_time_prior, one node)", "",
        "| " + " | ".join(PREDICTION_COLUMNS) + " |", "|" + "|".join(["---:"] * len(PREDICTION_COLUMNS)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in prediction_rows(predictions, job.batch_size, ddp)]
    return "\n".join(lines) + "\n"


def _predictions_json(predictions: Sequence[StepTimeBreakdown]) -> bytes:
    return (json.dumps([{**asdict(p), "step_s": p.step_s} for p in predictions], indent=2) + "\n").encode()


# --- the whole profile ---------------------------------------------------------------------------

def _swap_in(staging: Path, final: Path) -> None:
    """Replace `final` by `staging` whole: the old profile stays until the new one is complete."""
    old = final.with_name(f".{final.name}-old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def measure_profile(job: ProfileJob) -> ProfileResult:
    """Profile the job and write its directory. Raises the profiler's CampaignErrors; a failed
    DDP part is recorded in the result instead (the rest of the profile stands)."""
    staging = job.out_dir.with_name(f".{job.out_dir.name}-tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        profile, peaks = profile_layers(job)
        ddp, ddp_error = None, None
        if len(job.devices) > 1:
            try:
                ddp = run_ddp(plan_ddp(job, staging), job.devices)
            except DdpProfileError as exc:
                ddp_error = str(exc)
        predictions = predict(profile, peaks, ddp, job.predict_up_to)
        markdown = render_markdown(job, profile, peaks, ddp, predictions, ddp_error)
        plot_roofline(profile, peaks, staging / "roofline.png")
        write_atomic(staging / "profile.md", markdown.encode())
        write_atomic(staging / "profile.json", (profile.to_json() + "\n").encode())
        write_atomic(staging / "peaks.json", (json.dumps(peaks.to_dict(), indent=2) + "\n").encode())
        write_atomic(staging / "predictions.json", _predictions_json(predictions))
        files = tuple(sorted(p.name for p in staging.iterdir()))
        _swap_in(staging, job.out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ProfileResult(job.trial_id, job.out_dir, profile, peaks, ddp, predictions, markdown, ddp_error, files)


@task(name="profile trial")
def profile_trial(job: ProfileJob) -> ProfileResult | None:
    """The trial's profile, or None (with a warning that names the culprit) when it cannot be had."""
    logger = get_run_logger()
    started = time.perf_counter()
    try:
        result = measure_profile(job)
    except CampaignError as exc:
        logger.warning(f"trial {job.trial_id} goes on without a profile: {exc}")
        return None
    if result.ddp_error is not None:
        logger.warning(f"trial {job.trial_id}: profiled without its DDP part: {result.ddp_error}")
    logger.info(f"trial {job.trial_id} profiled on {', '.join(d.id for d in job.devices)} in {time.perf_counter() - started:.1f} s: {result.directory}")
    return result


# --- MLflow ----------------------------------------------------------------------------------------

PROFILED_TAG = "campaign.profiled_trial"  # not TRIAL_TAG: a trial's run is found by that, and this is not one


@task(name="open profile run", retries=2, retry_delay_seconds=1)
def open_profile_run(uri: str, parent_run_id: str, campaign: str, trial_id: str, label: str) -> str:
    """A run of its own for this profile, under the campaign's run (`campaign.kind` profile): the
    trials' runs keep only their training curves, and the campaign's view lists trials alone."""
    from tasks.tracking import KIND_TAG, PARENT_TAG

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_run(parent_run_id).info.experiment_id
    tags = {PARENT_TAG: parent_run_id, CAMPAIGN_TAG: campaign, KIND_TAG: "profile", PROFILED_TAG: trial_id}
    return client.create_run(experiment, run_name=f"profile {label}", tags=tags).info.run_id


def profile_tags(result: ProfileResult) -> dict[str, str]:
    """What the profile found, as the run's tags: the device, the measured step time (one device,
    and under DDP at its size) and the predicted one at each size of one node."""
    tags = {"profile.trial": result.trial_id, "profile.device": f"{result.peaks.device} ({result.peaks.name})",
            "profile.dir": str(result.directory), "profile.step_ms.measured_1": f"{result.profile.step.step_s * 1e3:.4g}"}
    if result.ddp is not None:
        tags[f"profile.step_ms.measured_{result.ddp.world_size}"] = f"{result.ddp.step_s * 1e3:.4g}"
    for p in result.predictions:
        if math.isfinite(p.step_s):
            tags[f"profile.step_ms.predicted_{p.devices}"] = f"{p.step_s * 1e3:.4g}"
    if result.ddp_error is not None:
        tags["profile.ddp_error"] = result.ddp_error.splitlines()[0][:500]
    return tags


@task(name="log profile", retries=2, retry_delay_seconds=1)
def log_profile(uri: str, run_id: str, result: ProfileResult) -> None:
    """The profile directory (its figures: roofline.png, profile.md, predictions.json...) as the
    run's artifacts under `profile/`, what it measured and predicted as tags (`profile_tags`):
    no metrics, whose charts would be two-point "curves" over device counts. The run ends FINISHED."""
    client = MlflowClient(tracking_uri=uri)
    client.log_artifacts(run_id, str(result.directory), artifact_path=MLFLOW_ARTIFACT_PATH)
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in profile_tags(result).items()])
    client.set_terminated(run_id, status="FINISHED")


RunState = tuple[str, int | None]  # MLflow status and end time


@task(name="read run states", retries=2, retry_delay_seconds=1)
def run_states(uri: str, experiment: str, campaign: str) -> dict[str, RunState]:
    """Status and end time of the campaign's runs, read before tasks.tracking reopens them
    (opening a run marks it RUNNING, which a profile must not leave behind)."""
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return {}
    runs = client.search_runs([found.experiment_id], filter_string=f"tags.`{CAMPAIGN_TAG}` = '{campaign}'", max_results=10_000)
    return {r.info.run_id: (r.info.status, r.info.end_time) for r in runs}


@task(name="restore run states", retries=2, retry_delay_seconds=1)
def restore_run_states(uri: str, before: dict[str, RunState], run_ids: Sequence[str]) -> None:
    """Put back what a profile changed: a finished (or failed) run keeps its status and end
    time; a run that was running stays running; a run the profile created is SCHEDULED,
    until `campaign launch` finds it by its tags and runs the trial in it."""
    client = MlflowClient(tracking_uri=uri)
    for run_id in run_ids:
        status, end_time = before.get(run_id, ("SCHEDULED", None))
        if status == "RUNNING":
            continue
        if end_time is None:
            client.update_run(run_id, status=status)
        else:
            client.set_terminated(run_id, status=status, end_time=end_time)
