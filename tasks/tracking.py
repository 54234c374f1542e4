"""MLflow: one parent run per campaign, one child run per trial, found again on resume.

Runs are looked up by tags, so launching the same campaign again (or `campaign resume`)
continues the same parent and child runs instead of creating duplicates.
"""

from __future__ import annotations

import atexit
import functools
import logging
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from tasks.grid import Trial
from tasks.hub_calls import in_hub, in_hub_unanswered
from tasks.mlflow_store import fold_log, make_from_template
from training.files import commit_to_wal

# MLflow is imported by the functions that use it: in a campaign with a hub they run there
# (tasks/hub_calls.py), and `launch` never imports it.

log = logging.getLogger(__name__)

CAMPAIGN_TAG = "campaign.name"
KIND_TAG = "campaign.kind"
TRIAL_TAG = "campaign.trial_id"
PARENT_TAG = "mlflow.parentRunId"
MAX_TAGS = 100  # MLflow's limit per log_batch


T = TypeVar("T")
ATTEMPTS, RETRY_DELAY_S = 3, 1.0


def retrying(fn: Callable[..., T]) -> Callable[..., T]:
    """Bookkeeping, not a Prefect task (a task run each would bury the trials' own in the UI):
    a tracking store that hiccups (a locked SQLite file, a server restarting) gets two more tries."""
    @functools.wraps(fn)
    def call(*args, **kwargs) -> T:
        for attempt in range(ATTEMPTS):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if attempt == ATTEMPTS - 1:
                    raise
                log.warning("%s failed (%s: %s); trying again", fn.__name__, e.__class__.__name__, e)
                time.sleep(RETRY_DELAY_S)
        raise AssertionError("unreachable")
    return call


def _client(uri: str):
    for build in list(_store_builds):  # a store built ahead (prepare_store) is used, not built twice
        build.join()  # returns at once if it has ended
    return _built_client(uri)


def _built_client(uri: str):
    from mlflow import MlflowClient

    make_from_template(uri)  # a new SQLite store without MLflow's migrations
    _sqlite_in_wal_mode()
    _opened.add(uri)
    return MlflowClient(tracking_uri=uri)


_opened: set[str] = set()  # the stores this process opened: their logs folded as it exits


def fold_logs() -> None:
    """The write-ahead log of each store this process opened, folded into its file
    (tasks.mlflow_store.fold_log): as this process exits, at rest each store is one file."""
    for uri in list(_opened):
        fold_log(uri)


atexit.register(fold_logs)


@functools.cache
def _sqlite_in_wal_mode() -> None:
    """Every SQLite store this process opens (MLflow's) commits into a write-ahead log
    (training.files.commit_to_wal): a campaign's hub commits ~8 times per trial. What the last
    commits held before a crash of the machine is on disk in the trials' folders (their
    results and metrics journals), from which a launch settles and refills the runs. The log
    is folded into the file as the process exits (fold_logs), and a new store never inherits
    an old one's (make_from_template)."""
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "connect")
    def _wal(dbapi_connection, _record) -> None:
        if isinstance(dbapi_connection, sqlite3.Connection):
            commit_to_wal(dbapi_connection)


def open_store(uri: str) -> None:
    """Build (and cache, in MLflow's registry) the tracking store of `uri` ahead of its first
    use; a failure is left for that use to report."""
    try:
        _built_client(uri)._tracking_client.store  # noqa: B018 (built on first access; a new SQLite store from the template, 1.5 s)
    except Exception:
        pass


@in_hub
def build_store(uri: str) -> None:
    """open_store, run by the campaign's hub (tasks.tracking_hub.build_store_ahead)."""
    open_store(uri)


_store_builds: list[threading.Thread] = []


def prepare_store(uri: str) -> None:
    """Start building the store of `uri` on a thread, and return: the next call waits for it.
    (A campaign's hub builds it as it starts: `tasks.tracking_hub --store`.)"""
    build = threading.Thread(target=open_store, args=(uri,), name="mlflow-store", daemon=True)
    _store_builds.append(build)
    build.start()


# MLflow's UI opens an experiment on its GenAI pages unless told it holds training runs.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def experiment_id(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            client.create_experiment(name, tags=dict([EXPERIMENT_KIND]))
        except MlflowException:  # another campaign created it a moment ago
            pass
        found = client.get_experiment_by_name(name)
    if EXPERIMENT_KIND[0] not in found.tags:  # made before this tag, or by hand: a kind the user set stays
        client.set_experiment_tag(found.experiment_id, *EXPERIMENT_KIND)
    return found.experiment_id


def runs_url(mlflow_ui: str, experiment: str) -> str:
    """The experiment's runs page (its bare page opens MLflow 3's GenAI overview)."""
    return f"{mlflow_ui.rstrip('/')}/#/experiments/{experiment}/runs"


# A campaign's view in MLflow's UI: its trials, one row each, the metric it ranks by and the
# parameters it varies as columns, best first; or their curves, that metric's first. MLflow's
# experiment page takes its search, sort and view mode from the URL, but its columns and
# charts only from a saved view: an experiment tag `mlflow.sharedViewState.<key>` holding the
# page's state as JSON, opened by `?viewStateShareKey=<key>` (its "Share" button writes one).
# The URL must carry no search of its own, or the page ignores the saved view.
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VIEW_METRICS = ("val_accuracy", "val_loss", "train_loss")  # columns and first charts after the ranking metric
MAX_VIEW_PARAMS = 30  # parameter columns (a wide search space: the first ones)


def view_key(campaign: str) -> str:
    """One saved view per campaign (campaign names are URL- and tag-safe: training.spec.CAMPAIGN_NAME),
    so a link printed by an earlier launch opens the latest view."""
    return f"campaign-{campaign}"


def campaign_view_url(mlflow_ui: str, experiment: str, campaign: str, charts: bool = False) -> str:
    """The campaign's trials in MLflow: a table (best first), or with `charts` their curves."""
    mode = "CHART" if charts else "TABLE"
    return f"{runs_url(mlflow_ui, experiment)}?viewStateShareKey={view_key(campaign)}&compareRunsMode={mode}"


def _line_chart(metric: str, section: str) -> dict[str, Any]:
    """A line chart card as MLflow's UI stores one (RunsChartsLineCardConfig), per step."""
    return {"uuid": f"campaign-{metric}", "type": "LINE", "metricKey": metric, "metricSectionId": section, "deleted": False,
            "isGenerated": True, "runsCountToCompare": 10, "lineSmoothness": 0, "xAxisScaleType": "linear", "scaleType": "linear",
            "xAxisKey": "step", "selectedXAxisMetricKey": "", "useGlobalXaxisKey": True, "useGlobalLineSmoothing": True,
            "yAxisKey": "metric", "yAxisExpressions": [], "ignoreOutliers": False, "range": {}}


def campaign_view(campaign: str, metric: str, mode: str, params: list[str]) -> dict[str, Any]:
    """The saved view of a campaign's trials (pure): only its trial runs (not the parent that
    folds them), sorted by `metric` (`mode`: max, best first), that metric, the losses and
    `params` as columns; in the charts, `metric` first, then the losses, then MLflow's own."""
    metrics = list(dict.fromkeys([metric, *VIEW_METRICS]))
    section = "campaign-model-metrics"
    return {
        "searchFilter": f"tags.`{CAMPAIGN_TAG}` = '{campaign}' and tags.`{KIND_TAG}` = 'trial'",
        "orderByKey": f"metrics.`{metric}`", "orderByAsc": mode == "min",
        "selectedColumns": [f"metrics.`{m}`" for m in metrics] + [f"params.`{p}`" for p in params[:MAX_VIEW_PARAMS]],
        # MLflow keeps its last two sections for the model's and the system's metrics; charts it
        # adds for other metrics go after ours, since the section counts as arranged by hand.
        "compareRunSections": [
            {"uuid": section, "name": "Model metrics", "display": True, "isReordered": True, "deleted": False, "isGenerated": True},
            {"uuid": "campaign-system-metrics", "name": "System metrics", "display": True, "isReordered": False, "deleted": False,
             "isGenerated": True}],
        "compareRunCharts": [_line_chart(m, section) for m in metrics],
    }


@in_hub
@retrying
def save_campaign_view(uri: str, experiment: str, campaign: str, metric: str, mode: str, params: list[str]) -> None:
    """Write the campaign's view (`campaign_view`) as its experiment's saved view `view_key(campaign)`."""
    _client(uri).set_experiment_tag(experiment, VIEW_TAG_PREFIX + view_key(campaign),
                                    json.dumps(campaign_view(campaign, metric, mode, params)))


def _find_run(client, exp_id: str, filter_string: str):
    runs = client.search_runs([exp_id], filter_string=filter_string, max_results=1, order_by=["attributes.start_time DESC"])
    return runs[0] if runs else None


def flatten(prefix: str, obj: Any) -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(f"{prefix}.{k}" if prefix else str(k), v))
        return out
    return {prefix: obj}


@in_hub
@retrying
def open_campaign_run(uri: str, experiment: str, campaign: str, grid: dict[str, list], n_trials: int) -> str:
    from mlflow.entities import Param

    client = _client(uri)
    exp_id = experiment_id(client, experiment)
    run = _find_run(client, exp_id, f"tags.`{KIND_TAG}` = 'campaign' and tags.`{CAMPAIGN_TAG}` = '{campaign}'")
    if run is None:
        run = client.create_run(exp_id, run_name=campaign, tags={KIND_TAG: "campaign", CAMPAIGN_TAG: campaign})
        params = [Param(f"grid.{k}", str(v)) for k, v in grid.items()] + [Param("trials", str(n_trials))]
        client.log_batch(run.info.run_id, params=params)
    else:
        client.update_run(run.info.run_id, status="RUNNING")
    return run.info.run_id


@in_hub
@retrying
def run_experiment(uri: str, run_id: str) -> str:
    return _client(uri).get_run(run_id).info.experiment_id


def open_trial_run(uri: str, parent_run_id: str, campaign: str, trial: Trial, scheduled: bool = False) -> str:
    """The trial's run, RUNNING (`scheduled`: SCHEDULED, staged to start later: `mark_running` then)."""
    return _open_trial_run(uri, parent_run_id, campaign, trial.id, trial.label, trial.spec.model_dump(mode="json"),
                           "SCHEDULED" if scheduled else "RUNNING")


@in_hub_unanswered
@retrying
def mark_running(uri: str, run_id: str) -> None:
    """A staged trial's SCHEDULED run: its trial started."""
    _set_open_status(_client(uri), run_id, "RUNNING")


def _set_open_status(client, run_id: str, status: str) -> None:
    """The status of a run that has not ended (no end time to keep), through the store's own
    `update_run_info` (the tracking store interface). `MlflowClient.update_run` reads the
    whole run first, its params, tags and latest metrics, only to keep its end time: 6 of the
    ~10 ms each change cost in the hub, where a short trial's opening and start both change
    one, and the hub's time per trial is what bounds how fast a campaign of short trials
    stages them."""
    from mlflow.entities import RunStatus

    client._tracking_client.store.update_run_info(run_id, RunStatus.from_string(status), end_time=None, run_name=None)


# A campaign run's experiment and its trials' runs (trial id -> run id), read from the store
# once, at the first trial it opens in this process, and kept as it opens more: a launch owns
# its campaign (flows/run/owner.py), so no one else adds trial runs under its run meanwhile,
# and each trial's opening costs two store calls instead of four.
_trial_runs: dict[tuple[str, str], tuple[str, dict[str, str]]] = {}


def _known_trial_runs(client, uri: str, parent_run_id: str) -> tuple[str, dict[str, str]]:
    known = _trial_runs.get((uri, parent_run_id))
    if known is None:
        exp_id = client.get_run(parent_run_id).info.experiment_id
        runs: dict[str, str] = {}
        token = None
        while True:  # the latest run of each trial, as _find_run would find it
            page = client.search_runs([exp_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'", max_results=1000,
                                      order_by=["attributes.start_time DESC"], page_token=token)
            for run in page:
                runs.setdefault(run.data.tags.get(TRIAL_TAG, ""), run.info.run_id)
            token = page.token
            if not token:
                break
        known = _trial_runs[(uri, parent_run_id)] = (exp_id, runs)
    return known


@in_hub
@retrying
def _open_trial_run(uri: str, parent_run_id: str, campaign: str, trial_id: str, label: str, spec: dict[str, Any],
                    status: str = "RUNNING") -> str:
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException

    client = _client(uri)
    exp_id, runs = _known_trial_runs(client, uri, parent_run_id)
    if (run_id := runs.get(trial_id)) is not None:  # an earlier launch's run: this one continues it
        try:
            client.update_run(run_id, status=status)
            return run_id
        except MlflowException:  # deleted since (by hand, in MLflow's UI): the trial gets a new one
            del runs[trial_id]
    tags = {PARENT_TAG: parent_run_id, TRIAL_TAG: trial_id, CAMPAIGN_TAG: campaign, KIND_TAG: "trial"}
    run = client.create_run(exp_id, run_name=label, tags=tags)
    _artifact_uris[run.info.run_id] = run.info.artifact_uri
    params = flatten("", spec)
    client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in sorted(params.items())])
    if status != "RUNNING":  # a new run starts RUNNING
        _set_open_status(client, run.info.run_id, status)
    runs[trial_id] = run.info.run_id
    return run.info.run_id


# The artifact folder of each trial run this process opened: a run's close logs its train.log
# there without reading the whole run back first (MlflowClient.log_artifact does, for its
# artifact folder: a few ms of CPU a trial, as much as a short trial's handover).
_artifact_uris: dict[str, str] = {}


def _log_artifact(client, run_id: str, path: str) -> None:
    if (artifact_uri := _artifact_uris.pop(run_id, None)) is None:  # a run an earlier launch opened
        client.log_artifact(run_id, path)
        return
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    get_artifact_repository(artifact_uri, tracking_uri=client.tracking_uri).log_artifact(path)


@in_hub_unanswered  # the loop goes on while the hub closes it: the end's drain, and any later call, come after it
@retrying
def close_trial_run(uri: str, run_id: str, result: dict[str, Any] | None, devices: list[str], error: str | None = None,
                    log_path: str | None = None, reading: dict[str, Any] | None = None) -> None:
    """The trial's run ends: its train.log, its final values and devices as tags, and
    `reading` (its system readings, tasks.system_metrics.SystemSampler.forget) in one
    `log_batch`; FINISHED, or FAILED with `error`."""
    from mlflow.entities import RunTag

    from tasks.system_metrics import reading_batch

    client = _client(uri)
    if log_path is not None and Path(log_path).is_file():  # the trainer's output, readable from the run's page
        _log_artifact(client, run_id, log_path)
    metrics, tags = reading_batch(reading) if reading is not None else ([], [])
    tags += [RunTag("devices", ",".join(devices)), RunTag("world_size", str(len(devices)))]
    if result is not None:
        tags.append(RunTag("checkpoint", result["checkpoint"]))
        tags.append(RunTag("campaign.state", "pruned" if result.get("pruned") else "finished"))
        # The final values as tags, not one-point metrics: the run's charts are its curves
        # (whose last points are these), and the runs table shows them as columns all the same.
        tags += [RunTag(f"final.{k}", f"{float(v):.6g}") for k, v in sorted(result["metrics"].items())]
        tags.append(RunTag("final.step", str(result["steps"])))
    if error:
        tags.append(RunTag("error", error[-4000:]))
    client.log_batch(run_id, metrics=metrics, tags=tags[:MAX_TAGS])
    client.set_terminated(run_id, status="FINISHED" if error is None else "FAILED")


@in_hub
@retrying
def close_campaign_run(uri: str, run_id: str, summary: dict[str, Any]) -> None:
    """The campaign's outcome on its parent run: counts and the best trial as tags
    (`summary.finished`, `summary.best.trial`...), the whole summary as `summary.json`. No
    one-point metrics: the compare view's first charts stay the trials' curves."""
    from mlflow.entities import RunTag

    client = _client(uri)
    flat = flatten("", {k: v for k, v in summary.items() if k != "per_trial"})
    tags = [RunTag(f"summary.{k}", f"{v:.6g}" if isinstance(v, float) else str(v)) for k, v in sorted(flat.items())]
    client.log_batch(run_id, tags=tags[:MAX_TAGS])
    client.log_dict(run_id, summary, "summary.json")
    client.set_terminated(run_id, status="FINISHED" if summary["failed"] == 0 else "FAILED")


@in_hub
def mark_killed(uri: str, run_ids: list[str]) -> None:
    """Runs a stopped campaign leaves behind: KILLED, not RUNNING forever. Not a task: this
    runs while the flow is being torn down."""
    client = _client(uri)
    for run_id in run_ids:
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status="KILLED")


def find_trial_run(uri: str, parent_run_id: str, trial_id: str):
    client = _client(uri)
    exp_id = client.get_run(parent_run_id).info.experiment_id
    return _find_run(client, exp_id, f"tags.`{PARENT_TAG}` = '{parent_run_id}' and tags.`{TRIAL_TAG}` = '{trial_id}'")


@in_hub
@retrying
def trial_run_id(uri: str, parent_run_id: str, trial_id: str) -> str | None:
    run = find_trial_run(uri, parent_run_id, trial_id)
    return None if run is None else run.info.run_id


@in_hub
@retrying
def retire_trial_run(uri: str, parent_run_id: str, trial_id: str, note: str) -> str | None:
    """`resume --rerun`: the trial's run is kept but is no longer the trial's (its trial tag
    becomes `<trial>@<note>`), so the rerun opens a run of its own whose curves start empty
    (the old run holds every step the rerun logs: they would be dropped as logged already).
    The old run's id, or None if the trial had none."""
    run = find_trial_run(uri, parent_run_id, trial_id)
    if run is None:
        return None
    _client(uri).set_tag(run.info.run_id, TRIAL_TAG, f"{trial_id}@{note}")
    known = _trial_runs.get((uri, parent_run_id))
    if known is not None and known[1].get(trial_id) == run.info.run_id:
        del known[1][trial_id]
    return run.info.run_id


@in_hub
@retrying
def settle_finished_run(uri: str, parent_run_id: str, trial_id: str, result: dict[str, Any]) -> bool:
    """A trial whose result is on disk but whose run is not FINISHED (its campaign was killed
    between the two): finish the run now. True if it had to."""
    run = find_trial_run(uri, parent_run_id, trial_id)
    if run is None or run.info.status == "FINISHED":
        return False
    devices = run.data.tags.get("devices", "")
    close_trial_run(uri, run.info.run_id, result, devices.split(",") if devices else [])
    return True


@in_hub
def log_files(uri: str, run_id: str, paths: list[Path | str], artifact_path: str) -> None:
    """Files (pictures of the campaign) as artifacts of a run."""
    client = _client(uri)
    for path in paths:
        client.log_artifact(run_id, str(path), artifact_path)
