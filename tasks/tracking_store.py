"""The campaign's MLflow store, checked before a launch and rebuilt from the campaign's files.

MLflow opens whatever file a `sqlite:///` URI names: a store truncated to nothing became a
new empty store on the next `campaign resume` (every finished trial's run gone, silently),
and a corrupt one failed the campaign after its flow started with an SQL error that named
neither the file nor `tracking.mlflow_uri`. So before anything runs (`flows/cli.py`
`_checked`), `check_tracking_store`:

- reads a SQLite store's file directly with sqlite3, never through MLflow (whose migrations
  would create tables in it): a regular file, SQLite's header, not shorter than the pages its
  header counts, `PRAGMA quick_check`, MLflow's tables;
- asks the store (the file, or an MLflow server's REST API) for every run the campaign's
  records name: its parent run (campaign.json) and each started trial's run (its trial.json);

and stops with exit 2 naming the file, what is wrong and the fix: `campaign repair-tracking`
(`repair_tracking`), which moves a broken store aside (kept, never deleted) and rebuilds the
campaign's runs from what it has on disk: the records, each trial's result, progress, log and
metrics journal where it has one. A new campaign (no run named) with no store gets one made as
before (tasks/mlflow_store.py, by the campaign's hub once the checks pass).
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tasks.mlflow_store import make_from_template, sqlite_file
from tasks.records import CampaignRecord, campaign_dir, read_campaign, read_trial_record, update_campaign
from training.config import TrialConfig
from training.errors import CampaignError
from training.files import SQLITE_COMPANIONS, InputError, read_json, write_atomic
from training.layout import campaign_files, campaign_records
from training.spec import CampaignSpec, tracking_uri

MLFLOW_TABLES = {"experiments", "runs", "metrics", "params", "tags"}  # what every MLflow SQLite store has, any version
SQLITE_HEADER = b"SQLite format 3\0"
# quick_check reads every page (~1 GB/s from the page cache): past this size the header's page
# count and the campaign's own runs are what is checked, so a launch never waits on it long.
QUICK_CHECK_MAX_BYTES = 1 << 30
LOCK_WAIT_S = 5.0  # an MLflow UI or another campaign writing to the store: waited on this long, never taken for corruption
METRICS_PER_BATCH = 1000  # MLflow's limit per log_batch


class TrackingStoreError(CampaignError):
    """The campaign's MLflow store cannot hold its runs as its records name them (exit 2)."""


def _where() -> str:
    return "$MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "tracking.mlflow_uri"


# --- the store's file ---------------------------------------------------------------------


def sqlite_problem(path: Path) -> str | None:
    """What is wrong with the SQLite MLflow store at `path` ("is truncated: ..."), or None when
    it is sound, absent or empty (SQLite and MLflow make a new store in an empty file; whether
    the campaign's runs are in it is `missing_runs`'s question). Never creates or changes it,
    beyond rolling back a transaction a killed writer left (what any reader of it does)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):  # a FIFO would block sqlite3's open; a directory is no store
        return "is not a regular file"
    if info.st_size == 0:
        return None
    try:
        with open(path, "rb") as f:
            header = f.read(100)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not header.startswith(SQLITE_HEADER):
        return "is not an SQLite database (its first bytes are not SQLite's header)"
    if len(header) < 100:
        return f"is truncated ({info.st_size} bytes: shorter than SQLite's header)"
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # The header's page count holds when the change counter it was written with is current.
    if header[24:28] == header[92:96] and pages and info.st_size < pages * page_size:
        return f"is truncated ({info.st_size} bytes of the {pages * page_size} its header counts)"
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=rw", uri=True, timeout=LOCK_WAIT_S)  # rw: never creates it
    except sqlite3.Error as e:
        return f"cannot be opened as an SQLite database ({e})"
    try:
        if info.st_size <= QUICK_CHECK_MAX_BYTES:
            verdict = [row[0] for row in db.execute("PRAGMA quick_check(5)")]
            if verdict != ["ok"]:
                return f"is corrupt (SQLite's quick_check: {'; '.join(map(str, verdict))})"
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.OperationalError as e:
        if "locked" in str(e) or "busy" in str(e):
            return None  # held by a writer: not broken; its runs are looked up next
        return f"is corrupt ({e})"
    except sqlite3.DatabaseError as e:  # "file is not a database", "database disk image is malformed"
        return f"is corrupt ({e})"
    finally:
        db.close()
    if tables and not MLFLOW_TABLES <= tables:
        return f"is an SQLite database but not an MLflow store (no table {', '.join(sorted(MLFLOW_TABLES - tables))})"
    return None


def _sqlite_runs(path: Path, run_ids: list[str]) -> set[str]:
    """The ones of `run_ids` the store at `path` holds (any lifecycle stage)."""
    if not path.exists() or path.stat().st_size == 0:
        return set()
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=LOCK_WAIT_S)
    try:
        if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone() is None:
            return set()
        marks = ",".join("?" * len(run_ids))
        return {row[0] for row in db.execute(f"SELECT run_uuid FROM runs WHERE run_uuid IN ({marks})", run_ids)}
    finally:
        db.close()


def _server_runs(uri: str, run_ids: list[str], timeout_s: float = 5.0) -> set[str]:
    """The ones of `run_ids` an MLflow server holds: each asked for by its REST API; only a
    clear "does not exist" counts a run missing (an answer we cannot read, or a refusal, does not)."""
    headers = {}
    if token := os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {token}"
    elif os.environ.get("MLFLOW_TRACKING_USERNAME"):
        import base64

        pair = f"{os.environ['MLFLOW_TRACKING_USERNAME']}:{os.environ.get('MLFLOW_TRACKING_PASSWORD', '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    held = set()
    for run_id in run_ids:
        url = f"{uri.rstrip('/')}/api/2.0/mlflow/runs/get?" + urllib.parse.urlencode({"run_id": run_id})
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s):
                held.add(run_id)
        except urllib.error.HTTPError as e:
            try:
                code = json.loads(e.read() or b"{}").get("error_code")
            except ValueError:
                code = None
            if code != "RESOURCE_DOES_NOT_EXIST":
                held.add(run_id)
        except (urllib.error.URLError, OSError, ValueError):
            held.add(run_id)  # unreachable: check_tracking says so; nothing to conclude here
    return held


def missing_runs(uri: str, run_ids: list[str]) -> list[str] | None:
    """The ones of `run_ids` the store at `uri` does not have, in order; None for a store this
    cannot ask cheaply (databricks, a file store: MLflow's own errors stand)."""
    if not run_ids:
        return []
    path = sqlite_file(uri)
    if path is not None:
        held = _sqlite_runs(path, run_ids)
    elif uri.lower().startswith(("http://", "https://")):
        held = _server_runs(uri, run_ids)
    else:
        return None
    return [r for r in run_ids if r not in held]


# --- what the campaign's records name -------------------------------------------------------


@dataclass(frozen=True)
class NamedRuns:
    """The MLflow runs a campaign's records name: its parent run, and each trial's by id."""

    parent: str | None
    trials: dict[str, str] = field(default_factory=dict)

    @property
    def all(self) -> list[str]:
        return ([self.parent] if self.parent else []) + list(self.trials.values())


def trial_config(trial_dir: Path) -> TrialConfig | None:
    """The trial's config (trial.json) as the campaign wrote it at its last start; None before one."""
    files = campaign_files(trial_dir.parent).trial(trial_dir.name)
    raw = read_json(files.config)
    if raw is None:
        return None
    try:
        return TrialConfig(**raw)
    except TypeError as e:
        raise InputError(f"{files.config} is not a trial config ({e}): move it aside (the trial's next start writes it again)") from None


def named_runs(runs_dir: Path, campaign: str) -> tuple[CampaignRecord | None, NamedRuns]:
    record = read_campaign(runs_dir, campaign)
    if record is None:
        return None, NamedRuns(None)
    root = campaign_dir(runs_dir, campaign)
    trials = {}
    for entry in record.trials:
        config = trial_config(root / entry.id)
        if config is not None and config.mlflow_run_id:
            trials[entry.id] = config.mlflow_run_id
    return record, NamedRuns(record.mlflow_run_id, trials)


def _repair_fix(params: Path | str, broken: bool) -> str:
    store = "moves it aside (kept), makes a new store and rebuilds" if broken else "rebuilds"
    return (f"`campaign repair-tracking {params}` {store} the campaign's runs in it from the campaign's files (records, "
            f"results, metrics), and `campaign resume {params}` then continues")


def check_tracking_store(spec: CampaignSpec, params: Path | str = "params.yaml") -> None:
    """Before a launch or resume: the store opens as one, and holds every run the campaign's
    records name; else TrackingStoreError naming the store, what is wrong and the fix."""
    uri = tracking_uri(spec.tracking)
    path = sqlite_file(uri)
    name = spec.campaign.name
    if path is not None and (problem := sqlite_problem(path)) is not None:
        raise TrackingStoreError(
            f"{_where()}: the MLflow store {path.resolve()} {problem}: campaign {name}'s runs cannot be read from it, and MLflow "
            f"would fail on it or make a new store over it. Fix: {_repair_fix(params, broken=True)}; or point "
            f"{_where()} at a sound copy of the store")
    _, runs = named_runs(spec.tracking.runs_dir, name)
    missing = missing_runs(uri, runs.all)
    if not missing:
        return
    store = f"the MLflow store {path.resolve()}" if path is not None else f"the MLflow server at {uri}"
    what = []
    if runs.parent in missing:
        what.append(f"the campaign's run {runs.parent} (in {campaign_files(campaign_dir(spec.tracking.runs_dir, name)).record})")
    if trials := [t for t, r in runs.trials.items() if r in missing]:
        what.append(f"{len(trials)} trial run(s) ({', '.join(trials[:3])}{', ...' if len(trials) > 3 else ''}: their trial configs)")
    raise TrackingStoreError(
        f"{_where()}: {store} does not have {' and '.join(what)} that campaign {name}'s records name: the store was replaced, "
        f"emptied or is another one, and a resume would start new runs without its trials' (finished ones included). Fix: "
        f"{_repair_fix(params, broken=False)}; or point {_where()} at the store that has them")


# --- the repair -----------------------------------------------------------------------------


@dataclass
class Repair:
    """What `repair_tracking` did, for the command to say."""

    store: str
    moved_aside: Path | None = None
    problem: str | None = None
    parent: str | None = None
    rebuilt: list[str] = field(default_factory=list)  # trials whose run was made again
    kept: list[str] = field(default_factory=list)  # trials whose run the store still had
    metric_points: int = 0
    journaled: list[str] = field(default_factory=list)  # rebuilt trials whose every logged step came from their journal
    others: list[str] = field(default_factory=list)  # other campaigns under runs_dir that name runs (a moved store had theirs too)


def set_store_aside(path: Path) -> Path:
    """Move the store and its SQLite companions (journal, WAL) to `<name>.broken-<time>`; kept."""
    aside = path.with_name(f"{path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
    while aside.exists():
        aside = aside.with_name(aside.name + "-")
    path.rename(aside)
    for suffix in SQLITE_COMPANIONS:
        companion = path.with_name(path.name + suffix)
        if companion.exists():
            companion.rename(aside.with_name(aside.name + suffix))
    return aside


def _run_exists(client, run_id: str | None) -> bool:
    from mlflow.exceptions import MlflowException

    if not run_id:
        return False
    try:
        client.get_run(run_id)
        return True
    except MlflowException:
        return False


def _campaign_axes(spec: CampaignSpec) -> tuple[dict[str, Any], int]:
    """What the campaign's run logs as parameters (flows/run/campaign.py): its axes, and its trials planned."""
    from tasks.grid import expand_grid, grid_points

    if spec.search is None:
        return dict(spec.grid), len(expand_grid(spec))
    varies = {k: str(v.model_dump()) for k, v in spec.search.space.items()}
    points = spec.search.trials if spec.search.strategy != "grid" else len(grid_points(spec))
    return varies, (points or 0) * spec.search.seeds


def _trial_params(spec: CampaignSpec, trial_id: str, overrides: dict[str, Any], config: TrialConfig) -> dict[str, Any]:
    """The trial's parameters as its run had them: its resolved spec, found again by its id
    (a grid point, or a search draw and its seed); from its config when the spec has changed since."""
    from tasks.grid import make_trial
    from tasks.tracking import flatten

    for seed_index in range(spec.search.seeds if spec.search is not None else 1):
        try:
            trial = make_trial(spec, overrides, seed_index)
        except Exception:  # a point the spec no longer admits
            break
        if trial.id == trial_id:
            return flatten("", trial.spec.model_dump(mode="json"))
    kept = ("seed", "model", "data", "optimizer", "loss", "steps", "batch_size", "lr", "schedule", "warmup_steps", "precision")
    return flatten("", {k: v for k, v in json.loads(config.to_json()).items() if k in kept})


def _journal(trial_dir: Path) -> list[tuple[str, int, float, int]] | None:
    """The trial's metrics journal, (key, step, value, ms) each, where the trainer keeps one; else None."""
    try:
        from training.metrics_journal import read_journal
    except ImportError:
        return None
    path = getattr(campaign_files(trial_dir.parent).trial(trial_dir.name), "metrics_journal", None)
    if path is None or not path.exists():
        return None
    return list(read_journal(path))


def _log_metrics(client, run_id: str, points: list[tuple[str, int, float, int]]) -> int:
    from mlflow.entities import Metric

    metrics = [Metric(key, value, stamp, step) for key, step, value, stamp in points]
    for start in range(0, len(metrics), METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[start:start + METRICS_PER_BATCH])
    return len(metrics)


def _rebuild_trial(client, uri: str, spec: CampaignSpec, experiment: str, parent: str, entry, trial_dir: Path,
                   config: TrialConfig, report: Repair) -> str:
    """The trial's run made again from its files; its id."""
    from mlflow.entities import Param, RunTag

    from tasks.records import completed_result
    from tasks.tracking import CAMPAIGN_TAG, KIND_TAG, MAX_TAGS, PARENT_TAG, TRIAL_TAG, close_trial_run
    from training.layout import trial_files
    from training.progress import read_progress

    record = read_trial_record(trial_dir)
    started = min((float(i["start"]) for i in record.intervals if isinstance(i.get("start"), (int, float))), default=None)
    tags = {PARENT_TAG: parent, TRIAL_TAG: entry.id, CAMPAIGN_TAG: spec.campaign.name, KIND_TAG: "trial", "campaign.rebuilt": "true"}
    run = client.create_run(experiment, run_name=entry.label, tags=tags,
                            start_time=int(started * 1000) if started else None)
    run_id = run.info.run_id
    params = _trial_params(spec, entry.id, entry.overrides, config)
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in sorted(params.items())])
    result = completed_result(trial_dir)
    progress = read_progress(trial_dir)
    journal = _journal(trial_dir)
    if journal:
        report.metric_points += _log_metrics(client, run_id, journal)
        report.journaled.append(entry.id)
    else:  # only the last values are on disk: the curve's last point, at the step they were reached
        stamp = int(time.time() * 1000)
        if result is not None:
            last = [(k, int(result["steps"]), float(v), stamp) for k, v in result["metrics"].items()]
        elif progress is not None:
            last = [(k, progress.step, float(v), stamp) for k, v in progress.metrics.items()]
        else:
            last = []
        report.metric_points += _log_metrics(client, run_id, last)
    log = trial_files(trial_dir).log
    if result is not None:  # FINISHED with the final values as tags and the log as an artifact, as at its end
        close_trial_run(uri, run_id, result, list(record.devices), log_path=str(log))
    elif record.state == "failed":
        close_trial_run(uri, run_id, None, list(record.devices), error=record.reason or "failed", log_path=str(log))
    else:  # stopped, interrupted, or killed before it could say: what a warden leaves
        client.log_batch(run_id, tags=[RunTag("devices", ",".join(record.devices))][:MAX_TAGS])
        client.set_terminated(run_id, status="KILLED")
    return run_id


def repair_tracking(spec: CampaignSpec) -> Repair:
    """Make the campaign's MLflow store hold its runs again: a broken SQLite store moved aside
    (kept) and a new one made; then every run the records name that the store lacks made again
    from the campaign's files, and the records rewritten to name the new runs."""
    from mlflow import MlflowClient

    from tasks.tracking import CAMPAIGN_TAG, KIND_TAG, PARENT_TAG, TRIAL_TAG, _find_run, experiment_id

    uri = tracking_uri(spec.tracking)
    path = sqlite_file(uri)
    report = Repair(store=str(path.resolve()) if path is not None else uri)
    if path is not None and (problem := sqlite_problem(path)) is not None:
        report.problem = problem
        report.moved_aside = set_store_aside(path)
        report.others = _other_campaigns(spec)
    elif path is not None and path.is_file() and path.stat().st_size == 0:
        path.unlink()  # nothing in it to keep: the template makes the new store at once, where MLflow's migrations take seconds
    make_from_template(uri)  # a new SQLite store as a new campaign gets one (nothing where one exists)
    runs_dir, name = spec.tracking.runs_dir, spec.campaign.name
    record, named = named_runs(runs_dir, name)
    if record is None:
        return report
    client = MlflowClient(tracking_uri=uri)
    experiment = experiment_id(client, spec.tracking.experiment)
    parent = named.parent if _run_exists(client, named.parent) else None
    if parent is None:
        found = _find_run(client, experiment, f"tags.`{KIND_TAG}` = 'campaign' and tags.`{CAMPAIGN_TAG}` = '{name}'")
        parent = found.info.run_id if found is not None else _rebuild_parent(client, spec, experiment, record)
    else:
        experiment = client.get_run(parent).info.experiment_id
    report.parent = parent
    root = campaign_dir(runs_dir, name)
    for entry in record.trials:
        trial_dir = root / entry.id
        config = trial_config(trial_dir)
        if config is None:
            continue  # never started: its run is made when it starts
        if _run_exists(client, config.mlflow_run_id):  # the store kept it (only the campaign's run was lost): under the new one
            if client.get_run(config.mlflow_run_id).data.tags.get(PARENT_TAG) != parent:
                client.set_tag(config.mlflow_run_id, PARENT_TAG, parent)
            report.kept.append(entry.id)
            continue
        # A repair stopped between making this trial's run and naming it in the trial's config
        # left that run behind: it goes (MLflow's deleted state), not a second run of the trial.
        for stale in client.search_runs([experiment], f"tags.`{PARENT_TAG}` = '{parent}' and tags.`{TRIAL_TAG}` = '{entry.id}' "
                                                      "and tags.`campaign.rebuilt` = 'true'"):
            client.delete_run(stale.info.run_id)
        run_id = _rebuild_trial(client, uri, spec, experiment, parent, entry, trial_dir, config, report)
        # Its config names its run: the next start writes it again, the check before it reads it now.
        write_atomic(campaign_files(root).trial(entry.id).config, replace(config, mlflow_run_id=run_id).to_json().encode())
        report.rebuilt.append(entry.id)
    update_campaign(runs_dir, name, mlflow_run_id=parent, mlflow_experiment_id=experiment)
    return report


def _rebuild_parent(client, spec: CampaignSpec, experiment: str, record: CampaignRecord) -> str:
    from mlflow.entities import Param

    from tasks.tracking import CAMPAIGN_TAG, KIND_TAG

    varies, planned = _campaign_axes(spec)
    run = client.create_run(experiment, run_name=spec.campaign.name,
                            tags={KIND_TAG: "campaign", CAMPAIGN_TAG: spec.campaign.name, "campaign.rebuilt": "true"},
                            start_time=int(record.started * 1000) if record.started else None)
    params = [Param(f"grid.{k}", str(v)) for k, v in varies.items()] + [Param("trials", str(planned))]
    client.log_batch(run.info.run_id, params=params)
    # The next launch sets it running again; until then it says how the campaign last ended.
    client.set_terminated(run.info.run_id, status="FINISHED" if record.state == "ended" else "KILLED",
                          end_time=int(record.ended * 1000) if record.ended else None)
    return run.info.run_id


def _other_campaigns(spec: CampaignSpec) -> list[str]:
    """Campaigns beside this one under runs_dir whose records name MLflow runs: a store they
    shared (the default sqlite:///mlflow.db is one per folder) held theirs too, and each then
    needs its own repair."""
    from tasks.records import read_campaign_file

    others = []
    for path in campaign_records(spec.tracking.runs_dir):
        try:
            other = read_campaign_file(path)
        except InputError:
            continue
        if other is not None and other.name != spec.campaign.name and other.mlflow_run_id:
            others.append(other.name)
    return sorted(others)
