"""The profile flow: one trial of a spec, profiled on leased devices of this host.

    spec -> the trial (default: the first of the grid) -> its size -> free devices, leased
    -> tasks/profile.py (per-layer table, roofline, DDP under torchrun, step-time prior)
    -> an MLflow run of its own under the campaign's (created as a campaign would make it),
       its figures as artifacts and what it measured as tags + a Prefect artifact

The devices are leased like a trial's, whole, so a profile never shares a device with a
running trial (its timings would be wrong, and on a GPU it could take the trial's memory).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Sequence

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from cluster.leases import Lease, LeaseStore, LeaseUnavailable
from cluster.packing import Packer
from cluster.sizing import SizedRequest, whole_devices
from cluster.types import WHOLE_DEVICE, Device, Inventory, Request
from flows.run.campaign import checked_requests, inventory_for
from training.spec import load_spec, tracking_uri
from tasks.grid import Trial, expand_grid
from tasks.profile import (ProfileResult, log_profile, open_profile_run, profile_dir, profile_job, profile_trial,
                           restore_run_states, run_states)
from tasks.tracking import open_campaign_run
from training.errors import CampaignError


class TrialNotFoundError(CampaignError):
    """The trial asked for is not in the spec's grid; the message lists the valid ids."""


class DevicesBusyError(CampaignError):
    """Too few devices of this host are free to profile the trial; the message names who holds them."""


@dataclass(frozen=True, slots=True)
class ProfileSummary:
    campaign: str
    trial_id: str
    label: str
    devices: tuple[str, ...]  # profiled on, rank order
    result: ProfileResult | None  # None: the trial could not be profiled (the flow logged why)
    mlflow_run_id: str | None = None  # the profile's own run
    artifact_key: str | None = None  # the Prefect markdown artifact


def select_trial(trials: Sequence[Trial], trial_id: str | None) -> Trial:
    """The trial with `trial_id`, or the first one; TrialNotFoundError lists the valid ids."""
    if trial_id is None:
        return trials[0]
    for trial in trials:
        if trial.id == trial_id:
            return trial
    listed = "\n".join(f"  {t.id}  ({t.label})" for t in trials)
    raise TrialNotFoundError(f"the grid has no trial {trial_id!r}; its trials are:\n{listed}")


def artifact_key(campaign: str, trial_id: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) for the trial's profile."""
    return re.sub(r"[^a-z0-9-]+", "-", f"profile-{campaign}-{trial_id}".lower()).strip("-")


def largest_node_size(inventory: Inventory) -> int:
    return max(sum(d.node == n for d in inventory.devices) for n in inventory.nodes)


def free_devices(inventory: Inventory, request: SizedRequest, leases: Sequence[Lease]) -> list[Device]:
    """Whole, free devices for the largest size the trial can run at on one node of this
    host, placed as the packer would place the trial (best links); DevicesBusyError names
    the devices held by others."""
    used: dict[str, int] = {}
    holders: dict[str, list[str]] = {}
    for lease in leases:
        used[lease.device_id] = used.get(lease.device_id, 0) + lease.memory_bytes
        holders.setdefault(lease.device_id, []).append(lease.holder)
    count = min(request.max_devices, largest_node_size(inventory))
    need = request.memory_for[0]  # whole devices that hold what the trial asks at its smallest size
    whole = whole_devices(inventory, None if need == WHOLE_DEVICE else need)
    placement = Packer(inventory, used).place(Request(request.trial_id, count, whole))
    if placement is None:
        held = [f"{d} (held by {', '.join(holders[d])})" for d in sorted(holders)]
        raise DevicesBusyError(
            f"trial {request.trial_id} is profiled on {count} whole device(s) of one node, and too few are free now: "
            f"{'; '.join(held) or 'none is held, but the free ones have less memory than the trial needs'}. "
            "Profile it when they are released (`campaign cluster` shows who holds what)."
        )
    return [inventory.device(d) for d in placement.device_ids]


@flow(name="profile")
def profile_flow(params_path: str = "params.yaml", trial_id: str | None = None) -> ProfileSummary:
    """Profile one trial of the spec (default: the first) and log it to an MLflow run of its own."""
    logger = get_run_logger()
    spec = load_spec(params_path)
    trials = expand_grid(spec)
    trial = select_trial(trials, trial_id)
    inventory = inventory_for(spec)
    request = checked_requests(spec, [trial], inventory)[trial.id]  # a trial no node can hold fails here
    name = spec.campaign.name

    store = LeaseStore()
    devices = free_devices(inventory, request, store.leases())
    holder = f"{name}/profile/{trial.id}@{os.getpid()}"
    capacity = {d.id: d.memory_bytes for d in inventory.devices}
    job = profile_job(trial, devices, profile_dir(spec.tracking.runs_dir, name, trial.id), largest_node_size(inventory))
    logger.info(f"profiling trial {trial.id} ({trial.label}) on {', '.join(d.id for d in devices)}")
    try:
        with store.hold(holder, {d.id: d.memory_bytes for d in devices}, capacity) as lease:
            result = profile_trial(job)
            lost = lease.lost
    except LeaseUnavailable:  # another campaign took a device between the look and the lease
        raise DevicesBusyError(f"the devices chosen to profile trial {trial.id} ({', '.join(d.id for d in devices)}) were leased a moment ago: try again") from None
    if lost:
        # Reclaimed while it ran (this process stalled past the heartbeat timeout): another trial
        # may have shared the devices, so its timings are not the trial's alone. Nothing is kept.
        raise DevicesBusyError(f"the lease on {', '.join(d.id for d in devices)} was reclaimed while trial {trial.id} was "
                               "profiled on them (this process stopped renewing it in time), so another campaign may have "
                               "used them meanwhile; its figures are not kept: profile it again")
    summary = ProfileSummary(name, trial.id, trial.label, tuple(d.id for d in devices), result)
    if result is None:
        return summary

    uri, experiment = tracking_uri(spec.tracking), spec.tracking.experiment
    before = run_states(uri, experiment, name)
    parent_run_id = open_campaign_run(uri, experiment, name, spec.grid, len(trials))
    try:  # a run of its own, under the campaign's: the trial's run keeps its training curves alone
        run_id = open_profile_run(uri, parent_run_id, name, trial.id, trial.label)
        log_profile(uri, run_id, result)
    finally:
        restore_run_states(uri, before, [parent_run_id])
    key = artifact_key(name, trial.id)
    create_markdown_artifact(result.markdown, key=key, description=f"profile of trial {trial.id} ({trial.label}) of campaign {name}")
    logger.info(f"profile of trial {trial.id}: {result.directory}, MLflow run {run_id}, Prefect artifact {key}")
    return replace(summary, mlflow_run_id=run_id, artifact_key=key)
