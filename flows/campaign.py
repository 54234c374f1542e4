"""The campaign flow: spec -> trials -> placed on leased devices -> DDP runs -> records.

Orchestration only: grid expansion lives in tasks/grid.py, placement in cluster/packing.py,
leases in cluster/leases.py, training in training/. The loop below starts every trial
that fits on the free devices, waits for any to finish, releases its devices and repeats.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.futures import PrefectFuture, as_completed

from cluster.inventory import DeclaredNode, declared_inventory, discover
from cluster.leases import LeaseStore
from cluster.packing import Packer, check_fits, workload_of
from cluster.sizing import SizedRequest, start_size
from cluster.types import Inventory
from flows.spec import CampaignSpec, check_data, load_spec, tracking_uri
from tasks.grid import Trial, expand_grid
from tasks.sizing import size_trials
from tasks.records import campaign_dir, completed_result, update_record, write_campaign
from tasks.summary import write_summary
from tasks.tracking import close_campaign_run, close_trial_run, open_campaign_run, open_trial_run
from flows.live import LeaseHeartbeat, Running, serve_resizes
from tasks.trial import run_trial
from training.config import TrialConfig

WAIT_FOR_DEVICES_S = 2.0  # poll period while other campaigns hold every device we could use
CONTROL_POLL_S = 0.5  # how often running trials are checked for resize requests


def inventory_for(spec: CampaignSpec) -> Inventory:
    """The devices trials run on: this host's (GPUs through NVML, else CPU slots)."""
    return discover(cpu_slots=spec.cluster.cpu_slots)


def planning_inventory(spec: CampaignSpec) -> Inventory:
    """The declared cluster when the spec has one (for planning), else this host's devices."""
    if not spec.cluster.nodes:
        return inventory_for(spec)
    return declared_inventory([
        DeclaredNode(n.name, n.devices, int(n.memory_gb * 2**30), n.kind, n.model, tuple(n.nvlink_pairs))
        for n in spec.cluster.nodes
    ])


def checked_requests(spec: CampaignSpec, trials: list[Trial], inventory: Inventory) -> dict[str, SizedRequest]:
    """Size every trial and check each fits some node at its minimum: errors name the trial."""
    requests = size_trials(spec, trials, inventory)
    check_fits([r.at(r.min_devices) for r in requests.values()], inventory)
    return requests


def trial_config(spec: CampaignSpec, trial: Trial, trial_dir: Path, mlflow_run_id: str | None) -> TrialConfig:
    t = trial.spec.training
    model_kwargs = trial.spec.model.model_dump(exclude={"name"})
    return TrialConfig(
        trial_id=trial.id, seed=trial.spec.seed, model=trial.spec.model.name, model_kwargs=model_kwargs,
        data_path=str(trial.spec.data.path.resolve()), steps=t.steps, batch_size=t.batch_size, lr=t.lr,
        momentum=t.momentum, weight_decay=t.weight_decay, schedule=t.schedule, warmup_steps=t.warmup_steps,
        checkpoint_every=t.checkpoint_every, keep_checkpoints=spec.tracking.keep_checkpoints,
        log_every=t.log_every, eval_every=t.eval_every, trial_dir=str(trial_dir.resolve()),
        mlflow_tracking_uri=tracking_uri(spec.tracking), mlflow_run_id=mlflow_run_id,
    )


@flow(name="campaign", log_prints=True)
def campaign_flow(params_path: str = "params.yaml", lease_db: str | None = None) -> dict[str, Any]:
    logger = get_run_logger()
    spec = load_spec(params_path)
    check_data(spec)
    trials = expand_grid(spec)
    inventory = inventory_for(spec)
    requests = checked_requests(spec, trials, inventory)  # a request no node can hold fails now

    name, uri = spec.campaign.name, tracking_uri(spec.tracking)
    root = campaign_dir(spec.tracking.runs_dir, name)
    parent_run_id = open_campaign_run(uri, spec.tracking.experiment, name, spec.grid, len(trials))
    write_campaign(spec.tracking.runs_dir, name, {
        "name": name, "params": str(Path(params_path).resolve()), "mlflow_run_id": parent_run_id,
        "trials": [{"id": t.id, "label": t.label, "steps": t.spec.training.steps, "overrides": t.overrides,
                    "devices": [requests[t.id].min_devices, requests[t.id].max_devices]} for t in trials],
    })

    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    pending: list[Trial] = []
    for t in trials:
        done = completed_result(root / t.id)
        if done is not None:
            logger.info(f"trial {t.id} ({t.label}) already finished: skipped")
            results[t.id] = done
        else:
            pending.append(t)

    capacity = {d.id: d.memory_bytes for d in inventory.devices}
    store = LeaseStore(lease_db)
    heartbeat = LeaseHeartbeat(store, period_s=max(1.0, store.heartbeat_timeout_s / 4))
    running: dict[PrefectFuture, Running] = {}
    try:
        while pending or running:
            packer = Packer(inventory, store.usage(), workload=workload_of([requests[t.id].at(requests[t.id].min_devices) for t in pending]))
            for trial in list(pending):
                request = requests[trial.id]
                queued_min = sum(requests[t.id].min_devices for t in pending if t is not trial)
                free = sum(packer.free_bytes(d.id) == d.memory_bytes for d in inventory.devices)
                placement = start_size(request, lambda n: packer.place(request.at(n)), queued_min, free)
                if placement is None:
                    continue
                holder = f"{name}/{trial.id}@{os.getpid()}"
                claims = {d: placement.memory_bytes for d in placement.device_ids}
                if not store.acquire(holder, claims, capacity):
                    packer.release(placement)  # another campaign took a device a moment ago: next round
                    continue
                heartbeat.add(holder)
                devices = [inventory.device(d) for d in placement.device_ids]
                run_id = open_trial_run(uri, parent_run_id, name, trial)
                config = trial_config(spec, trial, root / trial.id, run_id)
                elastic = request.min_devices < request.max_devices
                update_record(root / trial.id, state="starting", devices=list(placement.device_ids))
                logger.info(f"trial {trial.id} ({trial.label}) starts on {', '.join(placement.device_ids)}")
                future = run_trial.with_options(name=f"trial {trial.label}").submit(config, devices, str(Path.cwd()), elastic)
                running[future] = Running(trial, request, devices, holder, run_id, root / trial.id, elastic)
                pending.remove(trial)
            if not running:
                if pending:  # every device we could use is leased by someone else
                    time.sleep(WAIT_FOR_DEVICES_S)
                continue
            try:
                future = next(as_completed(list(running), timeout=CONTROL_POLL_S))
            except TimeoutError:
                for job in running.values():
                    if line := serve_resizes(job, inventory, store, capacity):
                        logger.info(line)
                continue
            job = running.pop(future)
            heartbeat.release(job.holder)
            device_ids = job.device_ids
            try:
                result = future.result()
            except Exception as e:  # the task failed after its retries: record it, go on with the rest
                failed[job.trial.id] = str(e)
                close_trial_run(uri, job.run_id, None, device_ids, error=str(e))
                logger.error(f"trial {job.trial.id} failed: {str(e)[-2000:]}")
                continue
            if result.get("preempted"):
                logger.info(f"trial {job.trial.id} preempted: its devices are free, it resumes from its checkpoint later")
                pending.append(job.trial)
                continue
            results[job.trial.id] = result
            close_trial_run(uri, job.run_id, result, device_ids)
            logger.info(f"trial {job.trial.id} finished: {result['metrics']}")
    finally:
        heartbeat.close()

    summary = write_summary(spec, trials, results, failed)
    close_campaign_run(uri, parent_run_id, summary)
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(trials)} trials failed: {', '.join(failed)}; see `campaign status {name}`")
    return summary
