"""The campaign's record on disk: what `campaign status` reads and resume relies on.

    <runs_dir>/<campaign>/campaign.json          trials, their labels, the MLflow parent run
    <runs_dir>/<campaign>/<trial_id>/trial.json  the trainer's TrialConfig
    <runs_dir>/<campaign>/<trial_id>/record.json state, its owner process, devices, attempts (the orchestrator)
    <runs_dir>/<campaign>/<trial_id>/progress.json  step and latest metrics (the trainer, rank 0)
    <runs_dir>/<campaign>/<trial_id>/result.json    written once, after the final checkpoint
    <runs_dir>/<campaign>/<trial_id>/checkpoints/step-XXXXXXXX/  DCP checkpoints

Every file is written atomically, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.manifest import checkpoint_report, checkpoint_step
from training.progress import read_progress
from training.result import read_result
from training.files import InputError, read_bounded, read_json, write_json_atomic
from training.layout import campaign_files, latest_pointer, trial_files



def campaign_dir(runs_dir: Path, campaign: str) -> Path:
    return Path(runs_dir) / campaign


def write_campaign(runs_dir: Path, campaign: str, record: dict[str, Any]) -> None:
    write_json_atomic(campaign_files(campaign_dir(runs_dir, campaign)).record, record)
    latest_pointer(runs_dir).write_text(campaign + "\n")


def update_campaign(runs_dir: Path, campaign: str, **fields: Any) -> None:
    path = campaign_files(campaign_dir(runs_dir, campaign)).record
    write_json_atomic(path, {**(read_json(path) or {}), **fields})


def add_trial_entry(runs_dir: Path, campaign: str, entry: dict[str, Any]) -> None:
    """List one more trial in campaign.json (a search's draw), keeping those listed before."""
    path = campaign_files(campaign_dir(runs_dir, campaign)).record
    record = read_json(path) or {}
    trials = [t for t in record.get("trials", []) if t["id"] != entry["id"]] + [entry]
    write_json_atomic(path, {**record, "trials": trials})


def latest_campaign(runs_dir: Path) -> str | None:
    path = latest_pointer(runs_dir)
    try:
        name = read_bounded(path, 4096, fix="remove it (the next launch writes it again) or name the campaign").decode()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise InputError(f"{path} is not text: remove it (the next launch writes it again) or name the campaign") from None
    name = name.strip()
    if "/" in name or name in (".", ".."):
        raise InputError(f"{path} names {name!r}, not a campaign: remove it (the next launch writes it again) or name the campaign")
    return name or None


ACTIVE = ("starting", "running")  # states only true while the campaign process that wrote them lives
ENDED = ("finished", "pruned", "failed", "stopped", "interrupted", "preempted")  # nothing changes them but a launch


def process_identity(pid: int | None = None) -> str | None:
    """host:pid:start-time of a process (this one by default); None if it is gone. The start
    time tells a reused pid apart from the process that wrote a record."""
    pid = os.getpid() if pid is None else pid
    try:
        start = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return f"{socket.gethostname()}:{pid}:{start}"


def owner_alive(owner: str | None) -> bool:
    """Whether the process named by `owner` (process_identity) still runs; on another host: assumed so."""
    if not owner:
        return True  # written before owners were recorded: nothing to check against
    host, pid, _ = owner.rsplit(":", 2)
    if host != socket.gethostname():
        return True
    return process_identity(int(pid)) == owner


def update_record(trial_dir: Path, **fields: Any) -> dict[str, Any]:
    """Merge fields into the trial's record; an active state is stamped with its owner, this process."""
    record = read_json(trial_files(trial_dir).record) or {}
    if fields.get("state") in ACTIVE:
        fields["owner"] = process_identity()
    record.update(fields, updated=time.time())
    write_json_atomic(trial_files(trial_dir).record, record)
    return record


def record_state(record: dict[str, Any]) -> str:
    """The record's state, told true: an active state whose campaign process is gone (killed
    with no chance to say so) is 'interrupted'."""
    state = record.get("state", "pending")
    if state in ACTIVE and not owner_alive(record.get("owner")):
        return "interrupted"
    return state


def log_allocation(root: Path, trial_id: str, device_ids, reason: str) -> None:
    """Who had which device when: one line per change, in <campaign>/allocations.jsonl."""
    with open(campaign_files(root).allocations, "a") as f:
        f.write(json.dumps({"time": time.time(), "trial": trial_id, "devices": list(device_ids), "reason": reason}) + "\n")


def completed_result(trial_dir: Path) -> dict[str, Any] | None:
    """The trial's result if it finished, else None. Finished stays finished: a result whose
    checkpoints no longer verify (another checkpoint key) is not a reason to train again."""
    return read_result(trial_dir)


@dataclass(frozen=True)
class TrialStatus:
    trial_id: str
    label: str
    state: str
    step: int
    steps: int
    devices: list[str]
    metrics: dict[str, float]
    checkpoint: str | None
    refused: tuple[tuple[str, str], ...] = ()  # (checkpoint, why) newer than `checkpoint`, not trusted


def trial_status(trial_dir: Path, trial_id: str, label: str, steps: int) -> TrialStatus:
    record = read_json(trial_files(trial_dir).record) or {}
    progress = read_progress(trial_dir)
    result = read_result(trial_dir)
    agent = read_json(trial_files(trial_dir).agent_state) or {}  # an elastic trial's devices now
    state = ("pruned" if result.get("pruned") else "finished") if result else record_state(record)
    devices = agent["devices"] if state == "running" and agent.get("status") == "running" else record.get("devices", [])
    latest, refused = checkpoint_report(trial_files(trial_dir).checkpoints)
    return TrialStatus(
        trial_id=trial_id, label=label, state=state,
        # The newest of what the trainer said (at most once a second) and what it checkpointed.
        step=max(progress.step if progress else 0, checkpoint_step(latest) if latest else 0,
                 int(result.get("steps", 0)) if result else 0), steps=steps,
        devices=list(devices),
        metrics=dict(result["metrics"] if result else progress.metrics if progress else {}),
        checkpoint=str(latest) if latest else None,
        refused=tuple((d.name, why) for d, why in refused),
    )


def campaign_status(runs_dir: Path, campaign: str) -> list[TrialStatus]:
    record = read_json(campaign_files(campaign_dir(runs_dir, campaign)).record)
    if record is None:
        return []
    root = campaign_dir(runs_dir, campaign)
    return [trial_status(root / t["id"], t["id"], t["label"], t["steps"]) for t in record["trials"]]
