"""The `campaign` command (typer). Bad input exits with code 2 before anything starts."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tasks.records import ENDED as TERMINAL  # states nothing changes but a launch
from training.layout import campaign_records, trial_files
from training.process import skip_final_collection

skip_final_collection()  # before Prefect, MLflow and torch register their exit hooks: this one runs last

# Prefect phones home unless told not to, and these machines have no network for it.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The commands other than `launch` let Prefect start its own temporary server, and give it 20 s
# by default: on a loaded machine (two cores, a test run beside it) it once took longer and the
# command failed before its flow began. `launch` starts its own and gives it a minute (warmup.py).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

app = typer.Typer(help="Declarative ML experiment campaigns: params.yaml -> Prefect -> DDP trials -> MLflow + DVC. Prefect keeps "
                  "each project folder's runs in its own database (.campaign/prefect/prefect.db): --prefect-db, PREFECT_HOME or "
                  "PREFECT_API_URL share another.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)


@app.callback()
def _project_options(
    prefect_db: Optional[Path] = typer.Option(
        None, "--prefect-db", envvar="CAMPAIGN_PREFECT_DB", metavar="FILE",
        help="the Prefect database (SQLite) of the servers this folder's commands start (default: .campaign/prefect/prefect.db, "
             "the folder's own, so its `campaign ui` shows its campaigns and no other folder's; e.g. ~/.prefect/prefect.db to "
             "share Prefect's default one). Without it, a PREFECT_API_URL, PREFECT_HOME or Prefect's own database URL you set "
             "is kept"),
) -> None:
    from flows.servers.prefect_db import use_folder_database

    use_folder_database(Path.cwd(), prefect_db)  # before Prefect reads its settings (each command imports it later)

PARAMS = typer.Argument(Path("params.yaml"), help="campaign spec")


def _fail(message: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # '[1, 2]' is text, not markup
    raise typer.Exit(code)


@contextmanager
def _bad_input():
    """A CampaignError (a record or file that is not what it should be) exits 2 with its message."""
    from training.errors import CampaignError

    try:
        yield
    except CampaignError as e:
        _fail(str(e))


def _loaded(params: Path, pool: str | None = None):
    """The spec, parsed and validated as data (exit 2 naming the field), nothing imported
    beyond it; a pool's secret taken up."""
    from training.spec import load_spec
    from training.errors import CampaignError

    try:
        spec = load_spec(params, pool=pool)
        if spec.cluster.pool is not None:
            _use_pool_secret(spec.cluster.pool)
    except CampaignError as e:
        _fail(str(e))
    return spec


PRESTART_ENV = "CAMPAIGN_PRESTART_WORKERS"  # "0": do not start the first warm workers' zygote ahead (a bench compares)


def _checked(spec, params: Path | str = "params.yaml") -> tuple[list, object, dict]:
    """Check everything else that can be checked before a flow starts; the grid's trials,
    the devices they may use and their size requests."""
    from training.spec import check_data, check_tracking
    from training.errors import CampaignError
    from flows.run.campaign import checked_requests, inventory_for
    from tasks.grid import expand_grid
    from tasks.tracking_store import check_tracking_store

    try:
        _check_records(spec)
        check_data(spec)
        check_tracking(spec)
        # The store holds the runs the records name, and is one (sqlite3 only: nothing made or migrated).
        check_tracking_store(spec, params)
        trials = expand_grid(spec)
        if spec.cluster.pool is not None:
            from flows.pool.worker import require_server
            require_server()
        inventory = inventory_for(spec)
        requests = checked_requests(spec, trials, inventory)
    except CampaignError as e:
        _fail(str(e))
    return trials, inventory, requests


def _prestart_warm_workers(spec, trials, inventory, requests) -> None:
    """The zygote the first trials' warm workers are forked from imports torch and the
    trainer (~2 s of CPU, once) while Prefect's server and the flow start. Even where those
    keep every core busy it pays: 2 cores, 8 trivial trials on 2 slots, the command took
    7.15 s against 7.35 s started by the first trial (medians of 4, rounds alternating;
    `bench/launch_overhead.py --trials 8 --steps 2 --prestart-both`), though the first trial's
    record comes 0.8 s later (4.1 s against 3.3 s: its worker is ready sooner all the same).
    Before the zygote each worker imported for itself and starting them early lost there."""
    from cluster.leases import LeaseError, LeaseStore, LeaseStoreError
    from flows.run.campaign import warm_first_wave
    from tasks.trial import prestart_warm_workers

    if os.environ.get(PRESTART_ENV) == "0":
        return  # no worker would start: the lease file and the trials' records are not read
    try:
        usage = LeaseStore().usage()
    except (LeaseError, LeaseStoreError):  # the flow reports the lease file's problem itself
        return
    if first := warm_first_wave(spec, trials, inventory, requests, usage):
        from tasks.spares import adopt_zygote

        adopt_zygote(Path.cwd())  # the resident server's, torch imported already (tasks/spares.py), if it has one
    prestart_warm_workers(first, Path.cwd())


def _use_pool_secret(pool: str) -> None:
    """This process (and what it starts) a client of the pool's server, with its secret:
    before Prefect is imported, which reads its settings once. Exit 2 without one."""
    from flows.pool.secret import PoolSecretError, use_secret

    try:
        use_secret(pool)
    except PoolSecretError as e:
        _fail(str(e))


def _check_records(spec) -> None:
    """The campaign's own record, read now as the flow will (bounded, depth-limited): a record
    that is a FIFO, a device or junk exits 2 here, naming it, instead of failing the flow."""
    from tasks.records import read_campaign

    read_campaign(spec.tracking.runs_dir, spec.campaign.name)


def _set_aside_for_rerun(spec, trials, rerun: list[str]) -> None:
    """`resume --rerun TRIAL`: the trial's result and checkpoints moved aside (kept), so it
    trains again from scratch. Every id is checked before anything moves."""
    from tasks.records import campaign_dir, read_campaign
    from training.result import set_aside

    root = campaign_dir(spec.tracking.runs_dir, spec.campaign.name)
    record = read_campaign(spec.tracking.runs_dir, spec.campaign.name)
    known = {t.id for t in trials} | {t.id for t in (record.trials if record else ())}
    if unknown := [t for t in rerun if t not in known]:
        _fail(f"--rerun {unknown[0]}: campaign {spec.campaign.name} has no such trial; its trials: {', '.join(sorted(known)) or 'none'}")
    for trial in dict.fromkeys(rerun):
        aside = set_aside(root / trial)
        if aside is not None and record is not None and record.mlflow_run_id:
            from tasks.tracking import retire_trial_run
            from training.spec import tracking_uri

            retire_trial_run(tracking_uri(spec.tracking), record.mlflow_run_id, trial, aside.name)
        console.print(f"trial {trial}: " + (f"result, checkpoints and curves moved to {aside}; it trains again, logging to "
                                            f"a new MLflow run" if aside
                                            else "nothing to set aside; it runs as any unfinished trial"), highlight=False)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that the flow's cleanup runs: its trials stop
    before their leases go back (by default SIGTERM would end the process with none of it)."""


# How long `campaign launch` may take to end once told to (SIGTERM, Ctrl-C): its trials get
# tasks.trial.STOP_GRACE_S of it to go by themselves; past the bound every process of its
# trials is killed and it exits (the warden then ends what else it left and sets its records).
STOP_BOUND_S = 15.0
_stop_bound: threading.Timer | None = None


def _bound_the_stop() -> None:
    """From the first SIGTERM or Ctrl-C on, the process ends within STOP_BOUND_S, whatever its
    trials left behind or anything of the campaign waits for."""
    global _stop_bound
    if _stop_bound is None:
        _stop_bound = threading.Timer(STOP_BOUND_S, _stop_now)
        _stop_bound.daemon = True
        _stop_bound.start()


def _stop_now() -> None:
    from tasks.trial import kill_every_trial_process

    kill_every_trial_process()
    err.print(f"[bold red]error:[/] the campaign did not stop within {STOP_BOUND_S:g} s: its trials' processes were killed; "
              "`campaign launch` again resumes them from their checkpoints", highlight=False)
    sys.stderr.flush()
    os._exit(143)


def _terminate(signum, frame) -> None:
    _bound_the_stop()
    raise Terminated()


def _interrupt(signum, frame) -> None:
    _bound_the_stop()
    raise KeyboardInterrupt()


_ownership = None  # this process's hold on its campaign (flows/run/owner.py), for the process's life


def _own_the_run(spec, command: str) -> None:
    """Before anything runs: the host's lease store is usable by this user (else exit 2, not a
    private store that shares the devices with nobody), and no other run of this campaign is
    alive (else exit 2 naming it)."""
    global _ownership
    from cluster.leases import LeaseError, LeaseStore
    from flows.run.owner import claim_campaign
    from tasks.records import campaign_dir

    with _bad_input():
        try:
            LeaseStore().leases()
        except LeaseError:
            pass  # busy: the flow waits it out as it runs
        _ownership = claim_campaign(campaign_dir(spec.tracking.runs_dir, spec.campaign.name), spec.campaign.name, command,
                                    on_lost=_stop_for_new_owner)
    atexit.register(_ownership.release)  # refused input too: a folder it made for the lock alone is removed


def _stop_for_new_owner(owner) -> None:
    """A run on another host took this campaign over (its shared folder carries no lock across
    hosts, and this run was not seen renewing its record): this one stops as on SIGTERM, its
    trials recorded stopped, so that the two do not train them at once."""
    console.print(f"[red]campaign taken over by {owner.describe()} (this run was not seen renewing its owner record): "
                  "stopping this run[/red]", highlight=False)
    os.kill(os.getpid(), signal.SIGTERM)


def _report_to_ui() -> None:
    """While `campaign ui` runs for this folder, flows report to its Prefect server (set
    before Prefect is imported: it reads its settings then)."""
    from flows.servers.ui import running_ui

    if os.environ.get("PREFECT_API_URL"):
        return  # the user's own Prefect server
    if (ui := running_ui(Path.cwd())) is not None:
        os.environ["PREFECT_API_URL"] = ui["prefect_api"]
        console.print(f"reporting to the Prefect server of `campaign ui`: {ui['prefect_url']}", highlight=False)


def _unmake_project_folder(server) -> None:
    """A refused launch leaves nothing behind: the Prefect server it started (with its database
    in `.campaign/`) is stopped, and `.campaign/`, which it made, removed."""
    import shutil

    from flows.servers import resident

    if isinstance(server, resident.Resident):
        resident.stop(Path.cwd())
    else:
        server.stop()
    shutil.rmtree(Path.cwd() / ".campaign", ignore_errors=True)


def _prefect_server():
    """Where the launch's flow reports: the user's Prefect server (PREFECT_API_URL) or `campaign
    ui`'s (_report_to_ui set it), else the folder's resident server (flows/servers/resident.py;
    started now if none runs, to boot while the launch checks), else (CAMPAIGN_SERVER=off) a
    temporary server of the launch's own."""
    from flows.servers import resident
    from flows.servers.prefect_db import make_database_folder
    from flows.servers.warmup import WarmUp

    if not os.environ.get("PREFECT_API_URL"):
        make_database_folder()  # the server started now keeps the folder's runs in the folder
    if os.environ.get("PREFECT_API_URL") or not resident.enabled():
        return WarmUp()
    server = resident.Resident(Path.cwd())
    if server.started_here:
        console.print(f"[dim]a Prefect server for this folder starts: {os.environ['PREFECT_API_URL'].removesuffix('/api')} "
                      f"(later launches use it; it stops after {resident.idle_s() / 60:.0f} min unused, or with "
                      "`campaign stop-server`)[/]", highlight=False)
    return server


def _started(params: Path, pool: str | None, rerun: list[str] | None, command: str = "launch", phases=None, spec=None):
    """Everything before the flow: the spec loaded and checked, Prefect's server booting, the
    MLflow store, the first trials' zygote. Returns the spec, the server and the trials."""
    mark = phases.mark if phases is not None else (lambda phase: None)
    _report_to_ui()
    spec = spec or _loaded(params, pool)
    _own_the_run(spec, command)
    mark("the campaign is this run's (no other run of it is live)")
    if spec.cluster.pool is None and not spec.cluster.nodes:
        from cluster.inventory import discover, keep_off_cores, spare_cores

        # Before Prefect's server starts: the orchestration's processes stay off the cores of the trials' slots.
        keep_off_cores(spare_cores(discover(cpu_slots=spec.cluster.cpu_slots)))
    from training.spec import tracking_uri
    from flows.run.warden import start_warden
    from tasks.records import campaign_dir

    # Before Prefect starts its server: if this process is killed outright, the warden ends
    # what it left behind and sets its records straight (it writes nothing until then).
    start_warden(campaign_dir(spec.tracking.runs_dir, spec.campaign.name), tracking_uri(spec.tracking))
    made_folder = not (Path.cwd() / ".campaign").exists()
    warm = _prefect_server()  # it boots (if it must) while the checks below run
    booting = getattr(warm, "process", None) is not None  # a server starts here: it takes a core meanwhile
    mark("Prefect's server starting (in the background)" if booting else "Prefect's server found")
    # The process that makes the campaign's MLflow calls (tasks/tracking_hub.py; not a pool's
    # campaign) imports MLflow (~2 s of CPU) on the other core while the checks run here, when
    # no server boots beside them; with one booting, three processes on a small host only slowed
    # the checks (the first trial 0.6 s later, measured), so it starts after them. It writes
    # nothing until told the store (below, once the checks have passed).
    hub_early = spec.cluster.pool is None and not booting
    if hub_early:
        from tasks.tracking_hub import open_metrics_hub

        open_metrics_hub()
    try:
        trials, inventory, requests = _checked(spec, params)
    except typer.Exit:
        if made_folder:  # refused: the server started for it, and the folder it made, go too
            _unmake_project_folder(warm)
        raise
    mark("data, tracking store, devices and workloads checked")
    # Checked: the MLflow store may be made now (SQLite: its tables, ~2 s), while Prefect's
    # server finishes its start; the flow's first MLflow call waits for it.
    if spec.cluster.pool is None:
        from tasks.tracking_hub import build_store_ahead, open_metrics_hub

        if not hub_early:
            open_metrics_hub(store=tracking_uri(spec.tracking))
        else:
            build_store_ahead(tracking_uri(spec.tracking))
    else:
        from tasks.tracking import prepare_store

        prepare_store(tracking_uri(spec.tracking))  # on a thread
    mark("MLflow store opening (in the background)")
    if rerun:
        _set_aside_for_rerun(spec, trials, rerun)
    _prestart_warm_workers(spec, trials, inventory, requests)
    mark("the first trials' warm workers starting (in the background)")
    return spec, warm, trials


def _launch(params: Path, live: bool | None = None, pool: str | None = None, rerun: list[str] | None = None,
            command: str = "launch", timings: bool = False) -> None:
    from training.process import imports_without_gc

    phases = None
    if timings:
        from tasks.timings import Phases

        from tasks import timings as launch_timings

        phases = Phases(lambda line: console.print(f"[dim]timings[/] {escape(line)}", highlight=False))
        launch_timings.register(phases)  # the flow and the trials' launches mark theirs
        phases.mark("command started, spec read")
    spec = _loaded(params, pool)
    if not rerun and (done := _nothing_to_do(spec, params)) is not None:
        console.print(f"campaign [bold]{spec.campaign.name}[/]: every one of its {done['trials']} trials has ended before: "
                      f"nothing to train (`campaign resume {params} --rerun TRIAL` trains one again)", highlight=False)
        if phases is not None:
            phases.mark("trials' records read: nothing to do")
        _print_summary(done)
        return
    with imports_without_gc():  # the spec, the checks' torch, Prefect's engine: kept for the launch's life
        spec, warm, trials = _started(params, pool, rerun, command, phases, spec)
        from flows.run.campaign import campaign_flow
    from tasks.spares import in_spare

    if in_spare():  # Prefect read its settings and set its logging up before this command's environment and terminal were its own: again
        from prefect.context import refresh_global_settings_context
        from prefect.logging.configuration import setup_logging

        refresh_global_settings_context()
        setup_logging(incremental=False)
    if phases is not None:
        phases.mark("the flow's code imported")

    what = f"{len(trials)} trials" if spec.search is None else f"a {spec.search.strategy} search" + (f" of {spec.search.trials} points" if spec.search.trials else "")
    console.print(f"campaign [bold]{spec.campaign.name}[/]: {what}, {spec.resources.devices} device(s) each")
    previous = signal.signal(signal.SIGTERM, _terminate)
    previous_int = signal.signal(signal.SIGINT, _interrupt)
    watch = _watch_first_step(spec, trials, phases)
    try:
        if live if live is not None else console.is_terminal:
            summary = _launch_live(spec, params, pool, warm, phases)
        else:
            from flows.run.live_view import plain_console_logs

            plain_console_logs()
            warm.ready()
            _settle_dead_flow_run(spec.campaign.name, spec.tracking.runs_dir, lambda: [os.environ.get("PREFECT_API_URL")], owned=True)
            if phases is not None:
                phases.mark("Prefect's server ready; the flow starts")
            with warm.flow_settings():
                summary = campaign_flow(str(params), pool=pool)
    except Terminated:
        _fail("stopped by SIGTERM: running trials were stopped and their devices released; `campaign launch` again "
              "resumes from their checkpoints", code=143)
    except Exception as e:  # the flow has logged the details; say it plainly and exit non-zero
        if os.environ.get("PREFECT_API_URL") and "connect" in f"{e.__class__.__name__} {e}".lower():
            _fail(f"the Prefect server at {os.environ['PREFECT_API_URL']} stopped answering ({e}); what the trials did is "
                  f"recorded on disk (`campaign status`) and in MLflow, and `campaign launch` again resumes", code=1)
        _fail(str(e), code=1)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        if watch is not None:
            watch.stop()
        if _ownership is not None:  # the run has ended: another may start
            _ownership.release()
    if phases is not None:
        phases.mark("campaign ended")
    _print_summary(summary)


def _settle_dead_flow_run(name: str, runs_dir: Path, apis, owned: bool) -> None:
    """The campaign's last flow run, left Running by a process that died, marked Crashed
    (flows/run/crashed.py): by a launch, which owns the campaign now, through the server it
    reports to; by `status`, when no process owns it and a server of the folder answers. A
    record or server that fails here never stops the command: the next one tries again."""
    from flows.run.crashed import settle_dead_flow_run
    from tasks.records import campaign_dir, read_campaign

    try:
        said = settle_dead_flow_run(read_campaign(runs_dir, name), campaign_dir(runs_dir, name), apis, owned)
    except Exception as e:  # noqa: BLE001
        err.print(f"[yellow]could not check campaign {escape(name)}'s last flow run in Prefect ({escape(e.__class__.__name__)}: "
                  f"{escape(str(e))})[/]", highlight=False)
        return
    if said:
        console.print(f"[dim]{escape(said)}[/]", highlight=False, soft_wrap=True)


def _folder_prefect_apis() -> list[str | None]:
    """The Prefect APIs that serve this folder's runs, without starting one: its resident
    server, its `campaign ui`'s, the user's (PREFECT_API_URL)."""
    from flows.servers import resident
    from flows.servers.ui import running_ui

    found = resident.find(Path.cwd())
    ui = running_ui(Path.cwd())
    return [found and found["prefect_api"], ui and ui["prefect_api"], os.environ.get("PREFECT_API_URL")]


def _print_summary(summary: dict) -> None:
    best = summary.get("best")
    pruned = f", {summary['pruned']} pruned" if summary.get("pruned") else ""
    score = next(((k, v) for k, v in (best or {}).items() if k != "trial"), None)
    console.print(f"finished {summary['finished']}/{summary['trials']} trials{pruned}" + (f"; best {best['trial']}: {score[0]} {score[1]:.4f}" if score else ""))


def _nothing_to_do(spec, params: Path) -> dict | None:
    """The summary of a campaign with nothing left to train, read from its records without
    Prefect, torch or MLflow (a relaunch of it answers in a fraction of a second), or None when
    the launch has work to do or cannot tell without them: a grid (a search may add points), its
    every trial finished or pruned with a verified result, its last run ended (its summary and
    MLflow run closed), and its SQLite store still there."""
    from tasks.grid import expand_grid
    from tasks.mlflow_store import sqlite_file
    from tasks.records import campaign_status, read_campaign
    from tasks.summary import ranked_by, summarize
    from tasks.tracking_store import check_tracking_store
    from training.errors import CampaignError
    from training.spec import summary_not_ours, tracking_uri

    if spec.search is not None or spec.cluster.pool is not None:
        return None
    try:
        record = read_campaign(spec.tracking.runs_dir, spec.campaign.name)
        if record is None or record.state != "ended":
            return None
        trials = expand_grid(spec)
        if {t.id for t in trials} != {t.id for t in record.trials}:
            return None  # the grid changed: new trials to train
        rows = campaign_status(spec.tracking.runs_dir, spec.campaign.name)
        if not rows or any(r.state not in ("finished", "pruned") for r in rows):
            return None
        store = sqlite_file(tracking_uri(spec.tracking))
        if store is None or not store.is_file():
            return None  # a server's store, or one that is gone: the launch's own checks say what to do
        check_tracking_store(spec, params)  # sound, and holding the runs the records name (sqlite3 alone)
        summary = spec.tracking.summary
        if summary is not None and (not summary.is_file() or summary_not_ours(summary, spec.campaign.name)):
            return None
    except (CampaignError, OSError):
        return None  # the launch's checks report it, naming the file
    results = {r.trial_id: {"metrics": r.metrics} for r in rows}
    pruned = {r.trial_id for r in rows if r.state == "pruned"}
    return summarize(trials, results, {}, pruned, ranked_by(spec))


def _watch_first_step(spec, trials, phases):
    """With --timings: a watch that marks the first training step of any trial of the launch."""
    if phases is None:
        return None
    from tasks.timings import FirstStepWatch
    from tasks.records import campaign_dir
    from training.layout import trial_files
    from training.manifest import checkpoint_report, checkpoint_step

    root = campaign_dir(spec.tracking.runs_dir, spec.campaign.name)
    baselines = {}
    for trial in trials:
        latest, _ = checkpoint_report(trial_files(root / trial.id).checkpoints)
        baselines[root / trial.id] = checkpoint_step(latest) if latest else 0
    return FirstStepWatch(phases, baselines).start()


def _launch_live(spec, params: Path, pool: str | None, warm, phases=None):
    """The flow under a live table; Prefect's and the libraries' logs go to campaign.log."""
    from flows.run.campaign import campaign_flow
    from flows.run.live_view import LiveView, chatter_to_file
    from tasks.records import campaign_dir

    log_path = campaign_dir(spec.tracking.runs_dir, spec.campaign.name) / "campaign.log"
    chatter_to_file(log_path)
    warm.ready()  # Prefect's lines from its server's start go to the file too
    _settle_dead_flow_run(spec.campaign.name, spec.tracking.runs_dir, lambda: [os.environ.get("PREFECT_API_URL")], owned=True)
    if phases is not None:
        phases.mark("Prefect's server ready; the flow starts")
    with LiveView(console, spec.tracking.runs_dir, spec.campaign.name, log_path), warm.flow_settings():
        return campaign_flow(str(params), pool=pool)


LIVE = typer.Option(None, "--live/--no-live", help="a table of trials redrawn in place, Prefect's logs to <campaign>/campaign.log "
                    "(default: on in a terminal)")


POOL = typer.Option(None, "--pool", help="run the trials on this campaign pool's nodes (sets cluster.pool; needs PREFECT_API_URL)")


TIMINGS = typer.Option(False, "--timings", help="say each phase of the launch as it is reached, with its time since the "
                       "command started, up to the first training step and the end")


@app.command()
def launch(params: Path = PARAMS, live: Optional[bool] = LIVE, pool: Optional[str] = POOL, timings: bool = TIMINGS) -> None:
    """Run the campaign: completed trials are skipped, partial ones resume from their checkpoint."""
    _launch(params, live, pool, timings=timings)


RERUN = typer.Option(None, "--rerun", metavar="TRIAL", help="train this finished trial again from scratch (its result, "
                     "checkpoints and metrics journal are moved to rerun-<time>/ in its folder; it logs to a new MLflow "
                     "run); repeat for more trials")


@app.command()
def resume(params: Path = PARAMS, live: Optional[bool] = LIVE, pool: Optional[str] = POOL,
           rerun: Optional[list[str]] = RERUN, timings: bool = TIMINGS) -> None:
    """Resume a campaign (the same as launching its spec again); --rerun TRIAL trains a finished trial again."""
    _launch(params, live, pool, rerun, command="resume", timings=timings)


@app.command("stop-server")
def stop_server() -> None:
    """Stop this folder's resident Prefect server (the next launch starts it again)."""
    from flows.servers import resident

    state = resident.stop(Path.cwd())
    if state is None:
        console.print("no Prefect server runs for this folder", highlight=False)
    else:
        console.print(f"stopped this folder's Prefect server ({state['prefect_url']}, pid {state['pid']})", highlight=False)


@app.command("repair-tracking")
def repair_tracking(params: Path = PARAMS) -> None:
    """Rebuild the campaign's MLflow runs from its files: a broken store moved aside (kept), a new one made."""
    from flows.run.owner import claim_campaign
    from tasks.records import campaign_dir
    from tasks.tracking_store import repair_tracking as repair

    spec = _loaded(params)
    with _bad_input():  # not while a launch of it runs: its runs are being written
        ownership = claim_campaign(campaign_dir(spec.tracking.runs_dir, spec.campaign.name), spec.campaign.name, "repair-tracking")
    try:
        with _bad_input():
            report = repair(spec)
    except typer.Exit:
        raise
    except Exception as e:  # the store or server failed while rebuilding: what was done stays, a second run goes on
        _fail(f"rebuilding campaign {spec.campaign.name}'s MLflow runs in {_store_named(spec)} failed "
              f"({e.__class__.__name__}: {e}); run `campaign repair-tracking {params}` again", code=1)
    finally:
        ownership.release()
    say = lambda line, style=None: console.print(escape(line), style=style, highlight=False, soft_wrap=True)
    if report.moved_aside is not None:
        say(f"MLflow store {report.store} {report.problem}: moved aside to {report.moved_aside} (kept); a new store made")
    if report.parent is None:
        say(f"campaign {spec.campaign.name} has no record under {spec.tracking.runs_dir}: no run to rebuild")
    else:
        journaled = (f"; per-step history from the metrics journals of {len(report.journaled)}" if report.journaled else "")
        say(f"campaign {spec.campaign.name}: its run {report.parent}; {len(report.rebuilt)} trial run(s) rebuilt, "
            f"{len(report.kept)} kept; {report.metric_points} metric value(s) logged{journaled}"
            + ("" if len(report.journaled) == len(report.rebuilt) else " (a trial without a journal: its last values only)"))
        say(f"its records name the runs in the store now: `campaign resume {params}` continues")
    if report.others:
        say(f"campaigns {', '.join(report.others)} under {spec.tracking.runs_dir} name runs too: if they logged to the store "
            "moved aside, run `campaign repair-tracking` with each one's spec", style="yellow")


def _store_named(spec) -> str:
    from tasks.mlflow_store import sqlite_file
    from training.spec import tracking_uri

    uri = tracking_uri(spec.tracking)
    return str(sqlite_file(uri) or uri)


@app.command()
def plan(params: Path = PARAMS) -> None:
    """Show how the campaign's trials would be sized and placed (on cluster.nodes if declared)."""
    from cluster.packing import Packer, workload_of
    from flows.run.campaign import checked_requests, planning_inventory
    from training.spec import load_spec
    from tasks.grid import expand_grid
    from training.errors import CampaignError

    try:
        spec = load_spec(params)
        trials = expand_grid(spec)
        inventory = planning_inventory(spec)
        requests = checked_requests(spec, trials, inventory)
    except CampaignError as e:
        _fail(str(e))
    first_wave = [requests[t.id].at(requests[t.id].min_devices) for t in trials]
    packer = Packer(inventory, workload=workload_of(first_wave))
    table = Table(title=f"campaign {spec.campaign.name}: first wave on {len(inventory.devices)} {inventory.kind} device(s), {len(inventory.nodes)} node(s)")
    for col in ("trial", "devices", "memory/device", "placed on"):
        table.add_column(col)
    for request in first_wave:
        placement = packer.place(request)
        where = ", ".join(placement.device_ids) if placement else "waits for devices"
        memory = "whole device" if request.whole else f"{request.memory_bytes / 2**30:.2f} GiB"
        table.add_row(request.trial_id, str(request.devices), memory, where)
    console.print(table)


@app.command()
def profile(
    params: Path = PARAMS,
    trial: Optional[str] = typer.Option(None, "--trial", help="trial id (default: the grid's first; `campaign status` lists them)"),
) -> None:
    """Profile one trial on this host: per-layer table, roofline, DDP buckets and all-reduce, predicted step times."""
    from flows.run.campaign import checked_requests, inventory_for
    from flows.run.profile import profile_flow, select_trial
    from training.spec import load_spec
    from tasks.grid import expand_grid
    from tasks.profile import prediction_rows, prediction_table
    from training.errors import CampaignError
    from training.profiler import to_rich_table

    _report_to_ui()
    try:
        spec = load_spec(params)
        if spec.function:
            _fail(f"{params}: training.target runs your own training function, whose layers this project does not own: "
                  "`campaign profile` profiles the project's loop; profile your function with torch.profiler inside it")
        chosen = select_trial(expand_grid(spec), trial)
        checked_requests(spec, [chosen], inventory_for(spec))
    except CampaignError as e:
        _fail(str(e))
    if not os.environ.get("PREFECT_API_URL"):  # Prefect starts a server of its own, on the folder's database
        from flows.servers.prefect_db import make_database_folder

        make_database_folder()
    try:
        summary = profile_flow(str(params), chosen.id)
    except Exception as e:  # devices busy, or the flow failed: it has logged the details
        _fail(str(e), code=1)
    result = summary.result
    if result is None:
        _fail(f"trial {chosen.id} could not be profiled: the warning above says why", code=1)
    console.print(to_rich_table(result.profile, result.peaks, console.width))
    if result.ddp is not None:
        d = result.ddp
        console.print(f"DDP at {d.world_size} processes ({d.backend}): step {d.step_s * 1e3:.3f} ms, all-reduce {d.allreduce_bytes} B "
                      f"in {len(d.buckets)} bucket(s), {d.allreduce_s * 1e3:.3f} ms, {d.overlap_fraction:.0%} overlapped with backward")
    elif result.ddp_error:
        console.print(f"[yellow]DDP part failed:[/] {result.ddp_error.splitlines()[0]}")
    rows = prediction_rows(result.predictions, result.profile.batch_size, result.ddp)
    table = prediction_table(f"predicted step time of {chosen.id} (global batch {result.profile.batch_size}, one node)", rows,
                             console.width)
    console.print(table)
    console.print(f"profile in {result.directory}/ ({', '.join(result.files)}); MLflow run {summary.mlflow_run_id}; Prefect artifact {summary.artifact_key}")


def _campaign_name(campaign: Optional[str], runs_dir: Path) -> str:
    from tasks.records import latest_campaign

    name = campaign or latest_campaign(runs_dir)
    if name is None:
        _fail(f"no campaign found under {runs_dir}/: launch one with `campaign launch params.yaml`")
    return name


def _trial_matches(record, trial: str) -> list:
    """The trials of `record` that `trial` names: its whole id; else the ids whose readable part
    (the id without its hash suffix) is `trial`; else the ids that start with `trial`."""
    exact = record.trial(trial)
    if exact is not None:
        return [exact]
    if not trial:
        return []
    by_label = [t for t in record.trials if t.id.rsplit("-", 1)[0] == trial]
    return by_label or [t for t in record.trials if t.id.startswith(trial)]


def _one_trial(matches: list, name: str, trial: str):
    """The one trial `trial` names in campaign `name`, or None; exits 2 listing the candidates
    when it names more than one."""
    if len(matches) > 1:
        _fail(f"{trial!r} names {len(matches)} trials of campaign {name}: {', '.join(t.id for t in matches)} "
              "(pass more of the id)")
    return matches[0] if matches else None


def _trial_entry(record, name: str, trial: str):
    """The trial as the campaign record lists it, by its id, a unique prefix of it or its id
    without the hash suffix; exits 2 naming the trials there are (or the candidates)."""
    entry = _one_trial(_trial_matches(record, trial), name, trial)
    if entry is None:
        _fail(f"campaign {name} has no trial {trial!r}; its trials: {', '.join(t.id for t in record.trials) or 'none'}")
    return entry


def _find_trial(campaign: Optional[str], runs_dir: Path, trial: str):
    """The campaign that has `trial` and its entry: the named one, else the latest launched,
    else any campaign under runs_dir that lists it (the most recently started); exits 2
    naming where it looked and what to pass."""
    from tasks.records import CampaignRecord, read_campaign, read_campaign_file

    name = _campaign_name(campaign, runs_dir)
    record = read_campaign(runs_dir, name) or CampaignRecord(name=name)
    if campaign is not None or _trial_matches(record, trial):
        return name, _trial_entry(record, name, trial)
    found = []
    for path in campaign_records(runs_dir):
        other = read_campaign_file(path)
        entry = _one_trial(_trial_matches(other, trial), path.parent.name, trial) if other else None
        if entry is not None:
            found.append((float(other.started or 0.0), path.parent.name, entry))
    if not found:
        trials = ", ".join(t.id for t in record.trials) or "none"
        _fail(f"no campaign under {runs_dir}/ has a trial {trial!r}; the latest, {name}, has: {trials} "
              f"(`campaign status NAME` lists another campaign's; `--campaign NAME` picks it)")
    _, other_name, entry = max(found)
    if len(found) > 1:
        print(f"trial {entry.id} is in campaigns {', '.join(sorted(n for _, n, _ in found))}: showing {other_name}'s "
              "(--campaign NAME picks another)", file=sys.stderr)
    return other_name, entry


def _status_table(name: str, runs_dir: Path) -> tuple[Table, bool, list[str]]:
    """The campaign's trials as a table, whether every one has ended, and the lines under it: the
    checkpoints refused, and why a trial ended as it did where its state alone does not say."""
    from flows.run.live_view import trials_table
    from tasks.records import campaign_status, read_campaign

    record = read_campaign(runs_dir, name)
    rows = campaign_status(runs_dir, name, record)
    if not rows:
        _fail(_no_record(name, runs_dir))
    refused = [f"trial {r.trial_id}: checkpoint {checkpoint} refused: {why}"
               + (" (the trial stays finished; `campaign resume --rerun " + r.trial_id + "` trains it again)"
                  if r.state in ("finished", "pruned") else "")
               for r in rows for checkpoint, why in r.refused]
    # Why a trial ended as it did, where its state alone does not say (a stalled trial).
    refused += [f"trial {r.trial_id} {r.state}: {r.reason}" for r in rows if r.reason]
    return trials_table(name, rows, objective=record.objective if record else None), all(r.state in TERMINAL for r in rows), refused


def _no_record(name: str, runs_dir: Path) -> str:
    return f"campaign {name!r} has no record under {runs_dir}/{name}: check the name (or --runs-dir)"


@app.command()
def status(
    campaign: Optional[str] = typer.Argument(None, help="campaign name (default: the latest launched)"),
    runs_dir: Path = typer.Option(Path("checkpoints"), help="where campaigns keep their trials"),
    watch: bool = typer.Option(False, "--watch", "-w", help="redraw in place until every trial has ended (Ctrl-C to leave)"),
    interval: float = typer.Option(2.0, help="seconds between redraws with --watch"),
) -> None:
    """List the trials of a campaign: state, progress, devices, latest metric, checkpoint."""
    with _bad_input():
        name = _campaign_name(campaign, runs_dir)
        table, ended, refused = _status_table(name, runs_dir)
    _settle_dead_flow_run(name, runs_dir, _folder_prefect_apis, owned=False)
    if not watch:
        console.print(table)
        for line in refused:
            console.print(f"[yellow]{escape(line)}[/]", highlight=False, soft_wrap=True)
        return
    import time

    from rich.live import Live

    with Live(table, console=console, refresh_per_second=4) as live:
        while not ended:
            time.sleep(interval)
            with _bad_input():
                table, ended, _ = _status_table(name, runs_dir)
            live.update(table)


@app.command()
def logs(
    trial: str = typer.Argument(..., help="trial id (see `campaign status`)"),
    campaign: Optional[str] = typer.Option(None, help="campaign name (default: the latest launched)"),
    runs_dir: Path = typer.Option(Path("checkpoints"), help="where campaigns keep their trials"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing what the trial writes until it ends"),
) -> None:
    """Print a trial's log (train.log: the trainer's output and errors)."""
    import codecs
    import sys
    import time

    from tasks.records import campaign_dir
    from training.files import read_chunk

    with _bad_input():
        name, entry = _find_trial(campaign, runs_dir, trial)
    trial = entry.id
    trial_dir = campaign_dir(runs_dir, name) / trial
    log = trial_files(trial_dir).log
    position = 0
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode  # a character may straddle two pieces
    while True:
        if log.exists():
            while True:  # a megabyte at a time: a log of any size streams in bounded memory
                with _bad_input():
                    chunk = read_chunk(log, position, fix="it must be the trial's own log file")
                if not chunk:
                    break
                position += len(chunk)
                sys.stdout.write(decode(chunk))
                sys.stdout.flush()
        if not follow or _trial_done_for_good(trial_dir, trial, entry):
            if follow and log.exists() and log.stat().st_size > position:
                continue  # the last lines written as it ended
            return
        time.sleep(0.5)


def _trial_done_for_good(trial_dir: Path, trial: str, entry) -> bool:
    """What `logs -f` waits for: the trial has ended and nothing will run it again now. A trial
    that failed or was stopped is followed on while a run of its campaign is live (a `resume`
    just started: its record still says how the last run left it)."""
    from flows.run.owner import run_is_live
    from tasks.records import trial_status

    state = trial_status(trial_dir, trial, entry.label, entry.steps).state
    return state in TERMINAL and (state in ("finished", "pruned") or not run_is_live(trial_dir.parent))


@app.command()
def export(
    trial: Optional[str] = typer.Argument(None, help="trial id (see `campaign status`); default: the campaign's best finished trial"),
    campaign: Optional[str] = typer.Option(None, help="campaign name (default: the latest launched)"),
    runs_dir: Path = typer.Option(Path("checkpoints"), help="where campaigns keep their trials"),
    out: Optional[Path] = typer.Option(None, help="the file to write (default: exports/<campaign>/<trial>.pt)"),
) -> None:
    """Write a finished trial's trained weights (by default the best trial's) to one PyTorch file:
    torch.load(FILE)["model"] is the model's state_dict, ["model_spec"] its model section."""
    from tasks.export import default_trial, export_trial
    from tasks.records import CampaignRecord, read_campaign

    with _bad_input():
        if trial is None:
            name = _campaign_name(campaign, runs_dir)
            record = read_campaign(runs_dir, name)
            if record is None:
                _fail(_no_record(name, runs_dir))
            trial_id, _ = default_trial(runs_dir, record)
        else:
            name, entry = _find_trial(campaign, runs_dir, trial)
            record, trial_id = read_campaign(runs_dir, name) or CampaignRecord(name=name), entry.id
        target = out or Path("exports") / name / f"{trial_id}.pt"
        written = export_trial(runs_dir, record, trial_id, target)
    metric = written["objective"][0]
    score = f", {metric} {written['metrics'][metric]:.4f}" if metric in written["metrics"] else ""
    console.print(f"exported trial {trial_id} of {name} (step {written['step']}{score}) to {target}", highlight=False, soft_wrap=True)
    if "model_spec" in written:
        console.print(f'load it: model = training.workload.build_model(torch.load("{target}")["model_spec"]); '
                      f'model.load_state_dict(torch.load("{target}")["model"])', highlight=False, soft_wrap=True)
    else:
        console.print(f'load it: torch.load("{target}")["state"] is what the function saved with ctx.save', highlight=False, soft_wrap=True)


@app.command()
def resize(
    trial: str = typer.Argument(..., help="trial id (see `campaign status`)"),
    devices: int = typer.Argument(..., help="number of devices to continue on; 0 preempts"),
    campaign: Optional[str] = typer.Option(None, help="campaign name (default: the latest launched)"),
    runs_dir: Path = typer.Option(Path("checkpoints"), help="where campaigns keep their trials"),
    wait_s: float = typer.Option(120.0, help="how long to wait for the running campaign to answer"),
) -> None:
    """Ask a running elastic trial to continue on another number of devices."""
    from tasks.records import ACTIVE, campaign_dir, latest_campaign, read_campaign, read_trial_record
    from tasks.resize import request_resize, wait_for_answer
    from training.agent_state import read_agent_state

    with _bad_input():
        name = campaign or latest_campaign(runs_dir)
        record = read_campaign(runs_dir, name) if name else None
    if record is None:
        _fail(f"no campaign {name} under {runs_dir}/: check the name (or --runs-dir)" if name
              else f"no campaign has been launched under {runs_dir}/: pass --runs-dir, or --campaign")
    entry = _trial_entry(record, name, trial)
    trial = entry.id
    low, high = entry.devices
    if low == high:
        _fail(f"trial {trial} has a fixed size of {low} device(s): declare resources.devices as [min, max] to make it elastic")
    if devices != 0 and not low <= devices <= high:
        _fail(f"trial {trial} runs on {low} to {high} devices (0 preempts it): {devices} is outside that range")
    trial_dir = campaign_dir(runs_dir, name) / trial
    with _bad_input():
        agent = read_agent_state(trial_files(trial_dir).control)
        # A pool's trial across nodes runs under torchrun, with no agent of ours: its record says.
        state = agent.status if agent else "running" if read_trial_record(trial_dir).state in ACTIVE else None
    if state != "running":
        _fail(f"trial {trial} is not running (its agent says: {state or 'not started'}): only a running trial can be resized")
    request_id = request_resize(trial_dir, devices)
    result = wait_for_answer(trial_dir, request_id, wait_s)
    if result is None:
        _fail(f"no answer within {wait_s:.0f} s: is the campaign that runs {trial} still running?", code=1)
    if result.status != "applied":
        _fail(result.detail)
    console.print(f"trial {trial}: {result.detail}")


@app.command()
def ui(
    params: Path = PARAMS,
    prefect_port: int = typer.Option(0, help="the Prefect server's port (0: the one this folder used last, else 4200)"),
    mlflow_port: int = typer.Option(0, help="the MLflow UI's port (0: the one this folder used last, else 5000)"),
) -> None:
    """Start a Prefect server and the MLflow UI on 127.0.0.1 until Ctrl-C; launches from this folder report to it."""
    from training.spec import load_spec, tracking_uri
    from flows.servers.ui import (clear_state, describe, main_loop, remember_ports, reporting_campaigns, running_ui, stable_ports,
                          start_servers, stop_servers, write_state)
    from training.errors import CampaignError

    try:
        spec = load_spec(params)
    except CampaignError as e:
        _fail(str(e))
    folder = Path.cwd()
    if (other := running_ui(folder)) is not None:
        _fail(f"`campaign ui` already runs for this folder (pid {other['pid']}): {other['prefect_url']}, {other['mlflow_url']}")
    uri = tracking_uri(spec.tracking)
    ports, notes = stable_ports(folder, {"prefect": prefect_port, "mlflow": mlflow_port})
    for note in notes:
        console.print(note, highlight=False)
    from flows.servers.prefect_db import make_database_folder

    make_database_folder()  # its Prefect server shows this folder's campaigns (flows/servers/prefect_db.py)
    from flows.servers import resident

    # The folder's resident Prefect server, where launches report anyway (started here if none
    # runs): `campaign ui` adds the MLflow UI beside it. With PREFECT_API_URL set, or the resident
    # server turned off, it runs a Prefect server of its own, as before.
    resident_url = None
    try:
        if not os.environ.get("PREFECT_API_URL") and resident.enabled():
            state = resident.find(folder) or resident.wait_for(folder, resident.start(folder, ports["prefect"]))
            resident.register_client(folder)  # it does not stop for idleness while the UI runs
            resident_url = state["prefect_url"]
        servers = start_servers(uri, folder / ".campaign", ports["prefect"], ports["mlflow"], prefect_url=resident_url)
    except RuntimeError as e:
        _fail(str(e), code=1)
    write_state(folder, servers)
    remember_ports(folder, servers)
    try:
        for line in describe(servers, uri):
            console.print(line, highlight=False)
        for record in campaign_records(spec.tracking.runs_dir):  # what its UI shows of campaigns that died: Crashed
            _settle_dead_flow_run(record.parent.name, spec.tracking.runs_dir, lambda: [servers.prefect_api], owned=False)
        if servers.mlflow_url:  # straight to the campaign's trials, a row each, best first
            from mlflow import MlflowClient

            from tasks.summary import ranked_by, varied_params
            from tasks.tracking import campaign_view_url, experiment_id, save_campaign_view

            experiment = experiment_id(MlflowClient(uri), spec.tracking.experiment)
            metric, mode = ranked_by(spec)
            save_campaign_view(uri, experiment, spec.campaign.name, metric, mode, varied_params(spec))
            console.print(f"MLflow runs {campaign_view_url(servers.mlflow_url, experiment, spec.campaign.name)}   (campaign "
                          f"{spec.campaign.name}'s trials, best {metric} first; each campaign's end prints a link to their curves)",
                          highlight=False, soft_wrap=True)
        ready = "launches from this folder report to this Prefect server; " + (
            "Ctrl-C stops the MLflow UI (the folder's Prefect server stays for its launches: `campaign stop-server`)"
            if resident_url else "Ctrl-C stops both")
        code = main_loop(servers, busy=lambda: reporting_campaigns(spec.tracking.runs_dir, servers.prefect_api),
                         say=lambda line: console.print(line, highlight=False), ready=ready)
    finally:
        clear_state(folder)
        stop_servers(servers)
    if code is not None:
        _fail(f"a server exited with code {code}; see {folder / '.campaign'}/*-server.log", code=1)
    console.print("stopped the MLflow UI" if resident_url else "stopped the Prefect server and the MLflow UI")


@app.command()
def cluster(cpu_slots: Optional[int] = typer.Option(None, help="CPU slots when there is no GPU"),
            pool: Optional[str] = typer.Option(None, help="show this campaign pool's nodes instead (PREFECT_API_URL)")) -> None:
    """Show the devices, who holds them (leases) and how busy they are; or a pool's nodes."""
    from cluster.inventory import device_usage, discover
    from cluster.leases import LeaseStore
    from cluster.report import render_cluster

    if pool is not None:
        _show_pool(pool)
        return
    inventory = discover(cpu_slots=cpu_slots)
    console.print(render_cluster(inventory, LeaseStore().leases(), device_usage()))


def _show_pool(pool: str) -> None:
    from datetime import datetime, timezone

    from flows.pool.nodes import PoolError, check_name

    try:
        check_name("pool", pool)
    except PoolError as e:
        _fail(str(e))
    _use_pool_secret(pool)
    from flows.pool.remote import pool_nodes
    from flows.pool.worker import require_server

    try:
        require_server()
        nodes = pool_nodes(pool)
    except PoolError as e:
        _fail(str(e))
    now = datetime.now(timezone.utc)
    table = Table(title=f"pool {pool}: {sum(n.live for n in nodes)} of {len(nodes)} node(s) live")
    for col in ("node", "state", "address", "devices", "last heartbeat"):
        table.add_column(col)
    for n in nodes:
        beat = f"{(now - n.last_heartbeat).total_seconds():.0f} s ago" if n.last_heartbeat else "never"
        table.add_row(n.name, "live" if n.live else "dead", n.address,
                      f"{len(n.inventory.devices)} {n.inventory.kind}: {', '.join(d.id for d in n.inventory.devices)}", beat)
    console.print(table)


@app.command()
def worker(
    pool: str = typer.Option(..., help="the campaign pool (a Prefect process work pool) this node joins"),
    node: Optional[str] = typer.Option(None, help="this node's name in the pool (default: the host name)"),
    address: str = typer.Option("127.0.0.1", help="this node's address: where its trials' stores and rendezvous listen"),
    cpu_slots: Optional[int] = typer.Option(None, help="CPU slots when there is no GPU (default: one per core)"),
    interface: Optional[str] = typer.Option(None, help="the network interface of --address (default: found with `ip addr`)"),
    work_dir: Optional[Path] = typer.Option(None, help="where this node keeps the trials of a campaign whose folder it "
                                            "does not see (cluster.shared_storage: false; default ~/.campaign/work)"),
) -> None:
    """Make this machine a node of a campaign pool: publish its devices, run trial segments placed on it."""
    import socket

    from flows.pool.mirror import WORK_DIR_ENV
    from flows.pool.nodes import PoolError, check_name
    from flows.pool.secret import POOL_ENV

    try:
        check_name("pool", pool)
    except PoolError as e:
        _fail(str(e))
    _use_pool_secret(pool)  # its flow runs verify each segment's signature with it (flows/pool/segment.py)
    os.environ[POOL_ENV] = pool
    if work_dir is not None:  # its flow runs read it (flows/pool/mirror.py)
        os.environ[WORK_DIR_ENV] = str(work_dir.expanduser().resolve())
    from flows.pool.worker import run_worker

    try:
        code = run_worker(pool, node or socket.gethostname().lower(), address, cpu_slots, interface)
    except PoolError as e:
        _fail(str(e))
    raise typer.Exit(code)


pool_app = typer.Typer(help="A campaign pool's secret and server: nobody without the secret drives its nodes.", no_args_is_help=True)
app.add_typer(pool_app, name="pool")


@pool_app.command("init")
def pool_init(pool: str = typer.Option(..., help="the pool's name"),
              force: bool = typer.Option(False, "--force", help="replace an existing secret (every node then needs the new file)")) -> None:
    """Write the pool's secret (.campaign/pool-NAME.json, mode 0600): its Prefect server's auth string and the key that signs trial segments."""
    from flows.pool.nodes import PoolError, check_name
    from flows.pool.secret import PoolSecretError, init_secret

    try:
        check_name("pool", pool)
        path = init_secret(pool, force=force)
    except (PoolError, PoolSecretError) as e:
        _fail(str(e))
    console.print(f"pool {pool}: secret written to {path} (mode 0600). Next:\n"
                  f"  on the head node: campaign pool server --pool {pool} --host ADDRESS\n"
                  f"  give every node this file (the project folder is shared, or copy it; keep it 0600), then on each:\n"
                  f"  campaign worker --pool {pool} --node NAME --address NODE_ADDRESS", highlight=False)


@pool_app.command("server")
def pool_server(pool: str = typer.Option(..., help="the pool's name"),
                host: str = typer.Option("127.0.0.1", help="the address the nodes reach the server at"),
                port: int = typer.Option(4200, help="its port")) -> None:
    """Run the pool's Prefect server, requiring the pool's auth string (the UI asks for it: it is in the secret file)."""
    from flows.pool.secret import SERVER_AUTH_ENV, PoolSecretError, load_secret

    try:
        secret = load_secret(pool)
    except PoolSecretError as e:
        _fail(str(e))
    env = {**os.environ, SERVER_AUTH_ENV: secret.auth_string, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": f"http://{host}:{port}/api"}
    console.print(f"pool {pool}: Prefect server on http://{host}:{port} (API auth required); every node: "
                  f"export PREFECT_API_URL=http://{host}:{port}/api", highlight=False)
    from flows.servers.prefect_db import make_database_folder

    make_database_folder()  # the pool's runs in the head node's folder (flows/servers/prefect_db.py)
    os.execvpe(sys.executable, [sys.executable, "-m", "flows.servers.warmup", "--host", host, "--port", str(port)], env)


def main() -> None:
    if (code := _run_in_spare(sys.argv[1:])) is not None:
        raise SystemExit(code)
    app()


def _run_in_spare(argv: list[str]) -> int | None:
    """`launch` and `resume` run in the folder's resident server's spare launch, Prefect and
    the flow imported already (tasks/spares.py), where it has one this command may take: their
    exit code. None: this process runs the command."""
    from tasks.spares import LAUNCH_COMMANDS, enabled, run_command, state_path

    words = [a for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or argv[i - 1] != "--prefect-db")]
    if not words or words[0] not in LAUNCH_COMMANDS or "--help" in argv or os.environ.get("PREFECT_API_URL") or not enabled():
        return None  # a user's own Prefect server: not the resident one, whose spare it is
    from flows.servers import resident

    if not resident.enabled() or not state_path(Path.cwd(), "launch").exists():
        return None
    return run_command(Path.cwd(), argv)


if __name__ == "__main__":
    main()
