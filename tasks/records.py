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

import os
import socket
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from training.manifest import checkpoint_report, checkpoint_step
from training.agent_state import read_agent_state
from training.progress import read_progress
from training.result import REFINALISED, result_report
from training.files import InputError, append_json_line, envelope_problem, read_bounded, read_json, read_json_lines, read_status_json, write_atomic, write_json_atomic
from training.layout import campaign_files, latest_pointer, trial_files



def campaign_dir(runs_dir: Path, campaign: str) -> Path:
    return Path(runs_dir) / campaign


CAMPAIGN_SCHEMA = 1
_RECORD_FIX = "move it aside (a launch writes a new one; a search's earlier draws are then drawn again)"


@dataclass(frozen=True)
class TrialEntry:
    """A trial as campaign.json lists it (what `campaign status`, `logs` and `resize` read)."""

    id: str
    label: str
    steps: int
    overrides: dict[str, Any] = field(default_factory=dict)
    devices: tuple[int, int] = (1, 1)  # [min, max] as the campaign sized its request


@dataclass(frozen=True)
class CampaignRecord:
    """`campaign.json`: the campaign's trials, its state and owner, and where people look."""

    name: str
    trials: tuple[TrialEntry, ...] = ()
    state: str = "pending"  # running, ended, stopped, interrupted
    launches: int = 0  # the flow run's name counts them
    params: str | None = None
    owner: str | None = None  # process_identity() of the campaign process while it runs
    started: float | None = None
    ended: float | None = None
    mlflow_run_id: str | None = None  # the parent run
    mlflow_experiment_id: str | None = None
    mlflow_ui: str | None = None
    prefect_api: str | None = None  # a `campaign ui` waits for campaigns reporting to it
    flow_run_id: str | None = None
    # The metric its trials are ranked by, and min or max: `campaign status` marks the best
    # trial by it (None: a record from before it was kept; validation accuracy, highest).
    objective: tuple[str, str] | None = None
    schema: int = CAMPAIGN_SCHEMA

    def trial(self, trial_id: str) -> TrialEntry | None:
        return next((t for t in self.trials if t.id == trial_id), None)

    def to_json(self) -> dict[str, Any]:
        raw = asdict(self)
        raw["trials"] = [{**asdict(t), "devices": list(t.devices)} for t in self.trials]
        return raw

    @classmethod
    def from_json(cls, raw: Any, path: Path) -> "CampaignRecord":
        """The record in `raw` (read from `path`); InputError naming the file when it is not one."""
        if (problem := _campaign_problem(raw)) is not None:
            raise InputError(f"{path} is not a campaign record ({problem}): {_RECORD_FIX}")
        fields_ = {k: v for k, v in raw.items() if k != "trials"}
        fields_["schema"] = CAMPAIGN_SCHEMA  # 0 (before records had a version) has the same fields
        if fields_.get("objective") is not None:
            fields_["objective"] = tuple(fields_["objective"])
        trials = tuple(TrialEntry(id=t["id"], label=t["label"], steps=t["steps"], overrides=dict(t.get("overrides", {})),
                                  devices=tuple(t.get("devices", (1, 1)))) for t in raw.get("trials", []))
        return cls(trials=trials, **fields_)


_OPTIONAL_TEXT = ("params", "owner", "mlflow_run_id", "mlflow_experiment_id", "mlflow_ui", "prefect_api", "flow_run_id")


def _campaign_problem(raw: Any) -> str | None:
    if not isinstance(raw, dict):
        return "not a JSON object"
    schema = raw.get("schema", 0)
    if not isinstance(schema, int) or schema > CAMPAIGN_SCHEMA:
        return f"schema {schema!r}: written by a newer version of this tool (this one reads {CAMPAIGN_SCHEMA})"
    if unknown := sorted(set(raw) - set(CampaignRecord.__dataclass_fields__)):
        return f"unknown fields {unknown}"
    if not isinstance(raw.get("name"), str) or not isinstance(raw.get("state", ""), str):
        return "no name"
    if any(raw.get(k) is not None and not isinstance(raw[k], str) for k in _OPTIONAL_TEXT):
        return "a link or owner that is not text"
    objective = raw.get("objective")
    if objective is not None and not (isinstance(objective, list) and len(objective) == 2 and isinstance(objective[0], str)
                                      and objective[1] in ("min", "max")):
        return f"objective {objective!r} is not [metric, min|max]"
    if any(raw.get(k) is not None and (not isinstance(raw[k], (int, float)) or isinstance(raw[k], bool)) for k in ("started", "ended", "launches")):
        return "a time or count that is not a number"
    trials = raw.get("trials", [])
    if not isinstance(trials, list):
        return "trials is not a list"
    for t in trials:
        if not (isinstance(t, dict) and isinstance(t.get("id"), str) and isinstance(t.get("label"), str)
                and isinstance(t.get("steps"), int) and isinstance(t.get("overrides", {}), dict)
                and isinstance(t.get("devices", [1, 1]), list) and len(t.get("devices", [1, 1])) == 2
                and all(isinstance(d, int) for d in t.get("devices", [1, 1])) and not set(t) - set(TrialEntry.__dataclass_fields__)):
            return f"trial entry {str(t)[:80]} is not one"
    return None


def read_campaign_file(path: Path) -> CampaignRecord | None:
    """The record at `path`, None when there is none; InputError naming it when it is not one."""
    raw = read_json(path)
    return None if raw is None else CampaignRecord.from_json(raw, path)


def read_campaign(runs_dir: Path, campaign: str) -> CampaignRecord | None:
    return read_campaign_file(campaign_files(campaign_dir(runs_dir, campaign)).record)


def write_campaign(runs_dir: Path, record: CampaignRecord) -> None:
    write_json_atomic(campaign_files(campaign_dir(runs_dir, record.name)).record, record.to_json())
    write_atomic(latest_pointer(runs_dir), (record.name + "\n").encode())  # never seen empty: a launch refuses one


def update_campaign(runs_dir: Path, campaign: str, **fields: Any) -> CampaignRecord:
    record = read_campaign(runs_dir, campaign) or CampaignRecord(name=campaign)
    record = replace(record, **fields)
    write_json_atomic(campaign_files(campaign_dir(runs_dir, campaign)).record, record.to_json())
    return record


def add_trial_entry(runs_dir: Path, campaign: str, entry: TrialEntry) -> None:
    """List one more trial in campaign.json (a search's draw), keeping those listed before."""
    record = read_campaign(runs_dir, campaign) or CampaignRecord(name=campaign)
    update_campaign(runs_dir, campaign, trials=tuple(t for t in record.trials if t.id != entry.id) + (entry,))


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
# "unverified": the record says finished, but the trial's result.json is not a valid signed one
# (training.result): shown so, with the reason, until a launch re-finalises it.
ENDED = ("finished", "pruned", "failed", "stopped", "interrupted", "preempted", "unverified")  # nothing changes them but a launch


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


TRIAL_SCHEMA = 1


@dataclass(frozen=True)
class TrialRecord:
    """`record.json`: what the campaign knows of one trial (the orchestrator writes it)."""

    state: str = "pending"  # starting, running (ACTIVE); finished, pruned, failed, stopped, ... (ENDED)
    owner: str | None = None  # process_identity() of the campaign process, stamped on an active state
    devices: tuple[str, ...] = ()
    attempts: int = 0
    intervals: tuple[dict[str, Any], ...] = ()  # {"devices", "start", "end"}: who had which device when
    exit_code: int | None = None
    reason: str | None = None  # why it ended as it did, where the state alone does not say (a stall)
    updated: float | None = None
    schema: int = TRIAL_SCHEMA

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "devices": list(self.devices), "intervals": [dict(i) for i in self.intervals]}


def _trial_record_problem(raw: Any) -> str | None:
    if (wrong := envelope_problem(raw, TRIAL_SCHEMA, TrialRecord.__dataclass_fields__)) is not None:
        return wrong
    if not isinstance(raw.get("state", ""), str) or not isinstance(raw.get("owner") or "", str):
        return "a state or owner that is not text"
    if not isinstance(raw.get("devices", []), list) or not isinstance(raw.get("intervals", []), list):
        return "devices or intervals that are not lists"
    if not isinstance(raw.get("attempts", 0), int):
        return "attempts is not a whole number"
    if not isinstance(raw.get("reason") or "", str):
        return "a reason that is not text"
    return None


def read_trial_record(trial_dir: Path) -> TrialRecord:
    """The trial's record; a trial the campaign has not started yet has the empty one. A file
    that is not a record is warned about and read as that (the next update replaces it)."""
    raw = read_status_json(trial_files(trial_dir).record, _trial_record_problem)
    if raw is None:
        return TrialRecord()
    return TrialRecord(**{**raw, "devices": tuple(raw.get("devices", ())), "intervals": tuple(raw.get("intervals", ())),
                          "schema": TRIAL_SCHEMA})


def update_record(trial_dir: Path, **fields: Any) -> TrialRecord:
    """Set fields of the trial's record; an active state is stamped with its owner, this process."""
    if fields.get("state") in ACTIVE:
        fields["owner"] = process_identity()
    for name in ("devices", "intervals"):
        if name in fields:
            fields[name] = tuple(fields[name])
    record = replace(read_trial_record(trial_dir), **fields, updated=time.time())
    write_json_atomic(trial_files(trial_dir).record, record.to_json())
    return record


def record_state(record: TrialRecord) -> str:
    """The record's state, told true: an active state whose campaign process is gone (killed
    with no chance to say so) is 'interrupted'."""
    if record.state in ACTIVE and not owner_alive(record.owner):
        return "interrupted"
    return record.state


ALLOCATION_SCHEMA = 1


@dataclass(frozen=True)
class Allocation:
    """One line of `<campaign>/allocations.jsonl`: who had which device when. Each change of a
    trial's devices is a line (start, resize, moving, preempted, end, failed, lease lost), its
    devices those it holds from then on ([]: none); a start says how much of each device the
    packer gave the trial (its memory estimate; a whole device's memory, its first device's)."""

    time: float
    trial: str
    devices: tuple[str, ...]
    reason: str
    memory_bytes: int | None = None
    schema: int = ALLOCATION_SCHEMA

    def to_json(self) -> dict[str, Any]:
        raw = {**asdict(self), "devices": list(self.devices)}
        if self.memory_bytes is None:
            del raw["memory_bytes"]
        return raw


def _allocation_problem(raw: Any) -> str | None:
    if (wrong := envelope_problem(raw, ALLOCATION_SCHEMA, Allocation.__dataclass_fields__)) is not None:
        return wrong
    if not isinstance(raw.get("time"), (int, float)) or isinstance(raw.get("time"), bool):
        return "time is not a number"
    if not isinstance(raw.get("trial"), str) or not isinstance(raw.get("reason"), str):
        return "trial or reason is not a string"
    if not isinstance(raw.get("devices"), list) or not all(isinstance(d, str) for d in raw["devices"]):
        return "devices are not a list of names"
    if raw.get("memory_bytes") is not None and (not isinstance(raw["memory_bytes"], int) or isinstance(raw["memory_bytes"], bool)):
        return "memory_bytes is not a whole number"
    return None


def log_allocation(root: Path, trial_id: str, device_ids, reason: str, memory_bytes: int | None = None) -> None:
    """A change of a trial's devices, appended to its campaign's allocation log."""
    event = Allocation(time=time.time(), trial=trial_id, devices=tuple(device_ids), reason=reason, memory_bytes=memory_bytes)
    append_json_line(campaign_files(root).allocations, event.to_json())


def read_allocations(root: Path) -> list[Allocation]:
    """The campaign's allocation log, in the order written ([] before its first start); lines
    that are not one are skipped, warned (the log only feeds the timeline and the benches)."""
    return [Allocation(**{**raw, "devices": tuple(raw["devices"]), "schema": ALLOCATION_SCHEMA})
            for raw in read_json_lines(campaign_files(root).allocations, _allocation_problem)]


def completed_result(trial_dir: Path, warn: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The trial's result if it finished, else None. Finished means a valid result signed by
    this host's key; it stays finished when its checkpoints no longer verify. A result.json
    that is not one (malformed, unsigned, forged) is warned about through `warn` (default:
    Python's warnings), naming the file and what is wrong, and reads as none: the trial is
    launched again and re-finalised from its final checkpoint (training.result)."""
    result, problem = result_report(trial_dir)
    if problem is not None:
        message = f"ignoring {problem}; {REFINALISED}"
        if warn is not None:
            warn(message)
        else:
            warnings.warn(message, stacklevel=2)
    return result


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
    reason: str | None = None  # the record's word on why it ended so (a failed trial: stalled at step N for S s), or why its result was refused


def trial_status(trial_dir: Path, trial_id: str, label: str, steps: int) -> TrialStatus:
    record = read_trial_record(trial_dir)
    progress = read_progress(trial_dir)
    # Not read_result: status names a refused result on the trial's own line, not as a Python warning.
    result, result_refused = result_report(trial_dir, trial_id)
    agent = read_agent_state(trial_files(trial_dir).control)  # an elastic trial's devices now
    state = ("pruned" if result.get("pruned") else "finished") if result else record_state(record)
    if result_refused is not None and state in ("finished", "pruned"):
        state = "unverified"  # its record says finished, on the strength of a result that is not one
    # An elastic trial's agent says where it is (or last was: a finished trial's are its last
    # devices, not those it started on); the record holds where a trial was started.
    now_or_last = state == "running" and agent is not None and agent.status == "running" or state in ("finished", "pruned")
    devices = agent.devices if now_or_last and agent is not None and agent.devices else record.devices
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
        reason=(f"result refused: {result_refused}; {REFINALISED}" if result_refused is not None
                else record.reason if state == record.state else None),
    )


def campaign_status(runs_dir: Path, campaign: str, record: CampaignRecord | None = None) -> list[TrialStatus]:
    """Each trial's status; `record`: the campaign's record where the caller has read it already."""
    record = record if record is not None else read_campaign(runs_dir, campaign)
    if record is None:
        return []
    root = campaign_dir(runs_dir, campaign)
    return [trial_status(root / t.id, t.id, t.label, t.steps) for t in record.trials]
