"""The campaign flow: spec -> trials -> placed on leased devices -> DDP runs -> records.

Orchestration only: grid expansion lives in tasks/grid.py, placement in cluster/packing.py,
the elastic policy in cluster/policy.py, leases in cluster/leases.py, training in
training/. The loop starts trials on free devices, serves resizes, waits for any trial to
finish, releases its devices and repeats. Fixed-size trials start first-come first-served
at their size; elastic trials ([min, max] devices) are sized and resized by the policy,
which grows them when devices free up and shrinks them when others wait.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.futures import PrefectFuture

from cluster.inventory import DeclaredNode, declared_inventory, discover
from cluster.leases import LeaseStore, LeaseStoreBusy
from cluster.packing import Packer, check_fits, workload_of
from cluster.sizing import SizedRequest, start_size
from cluster.types import WHOLE_DEVICE, Device, Inventory, Placement
from training.spec import CampaignSpec, check_data, load_spec, tracking_uri
from tasks.grid import Trial, expand_grid
from tasks.search import Drawn, Search
from tasks.sizing import size_trials
from tasks.workload import check_trials, trial_function, trial_workload
from tasks.records import CampaignRecord, TrialEntry, add_trial_entry, campaign_dir, read_campaign, completed_result, trial_status, log_allocation, read_allocations, process_identity, update_campaign, update_record, write_campaign
from tasks.resize import answer, pending_request, request_resize
from tasks import timings
from tasks.summary import ranked_by, summary_markdown, varied_params, write_summary
from tasks.system_metrics import SystemSampler
from tasks.timeline import import_drawing_early, intervals, timeline_rows, write_timeline
from tasks.curves import campaign_curves
from flows.servers.ui import mlflow_ui
from tasks.tracking import campaign_view_url, run_experiment, save_campaign_view, close_campaign_run, close_trial_run, log_files, mark_killed, mark_running, open_campaign_run, open_trial_run, settle_finished_run, trial_run_id
from flows.run.handover import STAGE_DEPTH, RunOpener, Staged, may_stage, next_end, restage_moves, seconds_left, stage_ahead_s, staging_order
from flows.run.heartbeat import heartbeats
from flows.run.live import Hosts, LeaseHeartbeat, Running, resize_landed, serve_resizes
from flows.run.live_view import CampaignLog
from flows.pool.nodes import NODE_GRACE_S, PoolError, server_trouble_within
from flows.pool.remote import (agent_across_nodes, by_node, end_host, forget_recall, live_inventory, pool_nodes, prepare_pool, recall,
                               run_remote_trial, start_host)
from flows.run.scheduler import LiveScheduler, live_policy, usable_devices
from tasks.tracking_hub import close_metrics_hub, drain_metrics_hub, end_metrics_hub, open_metrics_hub
from tasks.trial import (Successor, TrialFailed, accept_launches, close_warm_workers, plan_launch, readmit, revoke, run_trial,
                         stage_successor, start_in_idle_worker, stop_launched_trials, ticket_taken, trial_process_groups,
                         unstage_successor)
from tasks.device_settings import check_device_settings
from training.agent_state import read_agent_state
from training.config import TrialConfig
from training.agent_commands import clear_commands
from training.batch_choice import batch_choice_now
from training.errors import CampaignError
from training.host_records import read_agent_store
from training.metrics import feed_journal, format_metrics
from training.progress import read_progress
from training.resize_log import NewPauses
from training.layout import trial_files
from prefect.runtime import flow_run as prefect_flow_run

WAIT_FOR_DEVICES_S = 2.0  # poll period while other campaigns hold every device we could use
CONTROL_POLL_S = 0.5  # how often running trials are checked for resize requests
BUSY_BACKOFF_S = (0.5, 10.0)  # a locked lease file: first and longest wait before the loop tries again
POOL_LOOK_S = 5.0  # how often a pool campaign looks for nodes that joined or left (a worker beats every 5 s)
# Tests: every trial waits before this step while `<trial_dir>/hold` exists (a step to kill at).
HOLD_ENV = "CAMPAIGN_HOLD_AT_STEP"


def trial_of(holder: str) -> str:
    """The trial id of a lease holder (CampaignRun.holder: campaign/trial@pid)."""
    return holder.split("/", 1)[1].rsplit("@", 1)[0]


def per_node_counts(devices: list[Device]) -> dict[str, int]:
    """How many of `devices` each node holds, in rank order."""
    return {node: len(mine) for node, mine in by_node(devices)}


def first_finished(futures: list[PrefectFuture], timeout_s: float) -> PrefectFuture | None:
    """One of `futures` that finished within `timeout_s`, or None.

    Not Prefect's `as_completed(timeout=...)`: in the main thread its timeout is a SIGALRM,
    which may land inside a lock's release and fail the campaign ('release unlocked lock',
    seen in CI). The trials' futures wrap the task runner's thread futures: wait on those."""
    wrapped = {f.wrapped_future: f for f in futures}
    done, _ = concurrent.futures.wait(wrapped, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
    return wrapped[next(iter(done))] if done else None


def inventory_for(spec: CampaignSpec) -> Inventory:
    """The devices trials run on: this host's (GPUs through NVML, else CPU slots), or the
    live nodes' of the spec's pool."""
    if spec.cluster.pool is not None:
        return live_inventory(spec.cluster.pool)
    return discover(cpu_slots=spec.cluster.cpu_slots)


def warm_first_wave(spec: CampaignSpec, trials: list[Trial], inventory: Inventory,
                    requests: dict[str, SizedRequest], usage: dict[str, int]) -> list[Device]:
    """Where the first one-device trials to run would start now (`usage`: what other
    campaigns lease), as the loop packs them: the devices whose warm workers are worth
    starting before the loop (tasks.trial.prestart_warm_workers). Empty unless the trials
    run in warm workers on this host."""
    if not spec.cluster.warm_workers or spec.cluster.pool is not None:
        return []
    root = campaign_dir(spec.tracking.runs_dir, spec.campaign.name)
    fixed = [requests[t.id].at(1) for t in trials if requests[t.id].min_devices == requests[t.id].max_devices == 1
             and completed_result(root / t.id) is None]
    packer = Packer(inventory, usage, workload=workload_of(fixed))
    placed = (packer.place(request) for request in fixed)
    return [inventory.device(p.device_ids[0]) for p in placed if p is not None]


def planning_inventory(spec: CampaignSpec) -> Inventory:
    """The declared cluster when the spec has one (for planning), else this host's devices."""
    if not spec.cluster.nodes:
        return inventory_for(spec)
    return declared_inventory([
        DeclaredNode(n.name, n.devices, int(n.memory_gb * 2**30), n.kind, n.model, tuple(n.nvlink_pairs))
        for n in spec.cluster.nodes
    ])


def checked_requests(spec: CampaignSpec, trials: list[Trial], inventory: Inventory) -> dict[str, SizedRequest]:
    """Build and try every distinct workload, size every trial and check each fits some node
    at its minimum: errors name the field and the trial."""
    check_device_settings(spec, trials, inventory.kind)
    check_trials(trials)
    requests = size_trials(spec, trials, inventory)
    # In a pool a trial may span nodes (torchrun's c10d rendezvous); on one host it is one node anyway.
    check_fits([r.at(r.min_devices) for r in requests.values()], inventory, multi_node=spec.cluster.pool is not None)
    return requests


def summary_key(campaign: str) -> str:
    """The Prefect artifact key (lowercase letters, digits, dashes) of the campaign's summary."""
    return re.sub(r"[^a-z0-9-]+", "-", f"campaign-{campaign}".lower()).strip("-")


def trial_entry(trial: Trial, request: SizedRequest) -> TrialEntry:
    """A trial as campaign.json lists it (what `campaign status` and `resize` read)."""
    return TrialEntry(id=trial.id, label=trial.label, steps=trial.spec.training.steps, overrides=dict(trial.overrides),
                      devices=(request.min_devices, request.max_devices))


def trial_config(spec: CampaignSpec, trial: Trial, trial_dir: Path, mlflow_run_id: str | None, request: SizedRequest,
                 pruning: dict[str, Any] | None = None) -> TrialConfig:
    t = trial.spec.training
    hold = os.environ.get(HOLD_ENV)
    return TrialConfig(pruning=pruning, hold_at_step=int(hold) if hold else None,
        trial_id=trial.id, seed=trial.spec.seed, **trial_workload(trial.spec), **trial_function(trial.spec), steps=t.steps, batch_size=t.batch_size, lr=t.lr,
        precision=t.precision, grad_clip_norm=t.grad_clip_norm, compile=t.compile, cuda_graphs=t.cuda_graphs,
        logical_ranks=t.logical_ranks or request.max_devices, scaling=t.scaling, lr_scaling=t.lr_scaling, max_batch_size=t.max_batch_size, reduction=t.reduction, max_device_batch=t.max_device_batch,
        schedule=t.schedule, warmup_steps=t.warmup_steps,
        checkpoint_every=t.checkpoint_every, keep_checkpoints=spec.tracking.keep_checkpoints,
        log_every=t.log_every, eval_every=t.eval_every, stall_timeout_s=t.stall_timeout_s, trial_dir=str(trial_dir.resolve()),
        mlflow_tracking_uri=tracking_uri(spec.tracking), mlflow_run_id=mlflow_run_id,
        checkpoint_remote=checkpoint_remote(spec, trial),
    )


def checkpoint_remote(spec: CampaignSpec, trial: Trial) -> dict[str, str] | None:
    """Where the trial's checkpoints travel (tracking.dvc_remote), keyed by campaign and trial."""
    if spec.tracking.dvc_remote is None:
        return None
    from training.checkpoint_remote import resolve_remote

    return {"url": resolve_remote(spec.tracking.dvc_remote), "key": f"{spec.campaign.name}/{trial.id}"}


class CampaignRun:
    """The state of one campaign flow run: what is pending, running, finished, and on what."""

    def __init__(self, spec: CampaignSpec, trials: list[Trial], inventory: Inventory, requests: dict[str, SizedRequest],
                 parent_run_id: str, lease_db: str | None, logger, search: Search | None = None):
        self.spec, self.inventory, self.requests, self.logger = spec, inventory, requests, logger
        self.name, self.uri = spec.campaign.name, tracking_uri(spec.tracking)
        self.root = campaign_dir(spec.tracking.runs_dir, self.name)
        self.parent_run_id = parent_run_id
        self.capacity = {d.id: d.memory_bytes for d in inventory.devices}
        self.store = LeaseStore(lease_db)
        self.heartbeat = LeaseHeartbeat(self.store, period_s=max(1.0, self.store.heartbeat_timeout_s / 4), on_lost=self.lease_lost,
                                        passed_on=lambda holder: ticket_taken(trial_of(holder)))
        self.results: dict[str, dict[str, Any]] = {}
        self.failed: dict[str, str] = {}
        self.pending: list[Trial] = []
        self.running: dict[PrefectFuture, Running] = {}
        self.staged: dict[str, Staged] = {}  # a running trial -> the trial staged after it (flows/run/handover.py)
        self.finished_s: list[float] = []  # the wall times of this run's trials that finished: how long one takes
        self.scheduler: LiveScheduler | None = None
        self.waiting_since: float | None = None  # when this campaign last told the lease store it waits
        self.search = search
        self.trials: list[Trial] = list(trials)  # every trial known so far (a search adds them as it draws)
        # The study's trials this run runs: those never told, and those told ended whose result is
        # refused or gone (their pruning rule applies again; a tell finds them told and is skipped).
        ids = {t.id for t in self.trials}
        self.drawn: dict[str, Drawn] = {d.trial.id: d for d in search.unfinished() + search.ended() if d.trial.id in ids} if search else {}
        self.pruned: set[str] = set()
        self.run_ids: dict[str, str] = {}  # trial -> its MLflow run, for the summary artifact
        self.opener = RunOpener(lambda trial, scheduled: open_trial_run(self.uri, self.parent_run_id, self.name, trial, scheduled))
        self.began: dict[str, float] = {}  # a started trial -> when, until its wall time is counted in finished_s
        self.resize_pauses = NewPauses()  # what each elastic trial's resizes cost it: the policy prices the next by it
        every = spec.tracking.system_metrics_every_s
        self.sampler = SystemSampler(self.uri, every, processes_of=trial_process_groups) if every > 0 else None
        accept_launches()
        # A pool's trials run on its nodes through the pool's segment deployment; this host only orchestrates.
        self.pool = spec.cluster.pool
        self.deployment = prepare_pool(self.pool) if self.pool else None
        self.shared_storage = spec.cluster.shared_storage
        self.hosts = Hosts(start=self.start_host, end=end_host) if self.pool else None
        self.next_pool_look = time.time() + POOL_LOOK_S
        if any(r.min_devices < r.max_devices for r in requests.values()):
            per_node = max(sum(d.node == n for d in inventory.devices) for n in inventory.nodes)
            policy = live_policy(spec.scheduling.resize_pause_s, spec.scheduling.min_run_s, spec.scheduling.order)
            self.scheduler = LiveScheduler(policy, per_node, multi_node=self.pool is not None)
        for t in trials:
            done = completed_result(self.root / t.id, warn=logger.warning)  # a refused result: said among the campaign's events
            if done is not None:
                logger.info(f"trial {t.id} ({t.label}) already finished: skipped")
                self.results[t.id] = done
                update_record(self.root / t.id, state="pruned" if done.get("pruned") else "finished")
                if done.get("pruned"):
                    self.pruned.add(t.id)
                if t.id in self.drawn:  # the campaign was killed before it told the study
                    self.search.tell(self.drawn.pop(t.id).number, done)
                if settle_finished_run(self.uri, parent_run_id, t.id, done):
                    logger.info(f"trial {t.id}: its MLflow run is marked FINISHED (the campaign was killed after its result)")
                self.feed_journal(t.id, lambda t=t: trial_run_id(self.uri, parent_run_id, t.id))
            else:
                self.add_pending(t)

    def feed_journal(self, trial_id: str, run_id: Callable[[], str | None]) -> None:
        """What of the trial's metrics journal its MLflow run lacks (a kill took it in flight)
        is sent now, through the hub, which logs each (key, step) once (training.metrics_journal).
        A pool's trials journal on their nodes, whose sinks send what they have."""
        journal = trial_files(self.root / trial_id).metrics_journal
        if self.pool is None and journal.exists() and (run := run_id()) is not None:
            feed_journal(journal, self.uri, run)

    def add_pending(self, trial: Trial) -> None:
        self.pending.append(trial)
        if self.scheduler is not None:
            from tasks.profile import load_prior, profile_dir  # torch, MLflow: only for elastic trials

            r = self.requests[trial.id]
            prior = load_prior(profile_dir(self.spec.tracking.runs_dir, self.name, trial.id))  # `campaign profile` ran on it
            if prior is not None:
                self.logger.info(f"trial {trial.id}: the scheduler starts from its profile's step-time prior")
            t = trial.spec.training
            growth = t.max_batch_size / t.batch_size if t.scaling == "goodput" and t.max_batch_size else 1.0
            self.scheduler.arrive(trial.id, r.min_devices, r.max_devices, time.time(), prior, max_batch_scale=growth, steps=t.steps)

    # --- starting trials -------------------------------------------------------------
    def start(self, trial: Trial, placement: Placement, serving: str | None = None) -> bool:
        """Lease the placement's devices and launch the trial on them; False if they were taken.
        `serving`: the resize request this start carries out (`relaunch`), not a stale one."""
        holder = self.holder(trial)
        if not self.store.acquire(holder, placement.claims(self.capacity), self.capacity, campaign=self.name):
            return False  # another campaign took a device a moment ago, or it is its turn: next round
        self.heartbeat.add(holder)
        run_id, config = self.prepare(trial)
        if self.pool is None:  # its workers watch this lease (training.fence); a pool node's segment fences on its own lease file
            config = dataclasses.replace(config, lease=self.store.fence(holder))
        # What it holds of its first device: its estimate where it shares, the device's memory where whole.
        log_allocation(self.root, trial.id, placement.device_ids, "start", placement.claims(self.capacity)[placement.device_ids[0]])
        self.launch(trial, placement, holder, run_id, config, serving)
        return True

    def holder(self, trial: Trial) -> str:
        return f"{self.name}/{trial.id}@{os.getpid()}"  # trial_of reads it back

    def prepare(self, trial: Trial, scheduled: bool = False) -> tuple[str, TrialConfig]:
        """The trial's MLflow run (opened, or an earlier launch's found; `scheduled`: it says
        SCHEDULED until the trial starts) and its config, without its lease."""
        opened = self.opener.take(trial)  # opened ahead, if it was
        if opened is None:
            run_id = open_trial_run(self.uri, self.parent_run_id, self.name, trial, scheduled)
        else:
            run_id, said_scheduled = opened
            if said_scheduled and not scheduled:
                mark_running(self.uri, run_id)
        self.run_ids[trial.id] = run_id
        self.feed_journal(trial.id, lambda: run_id)
        drawn = self.drawn.get(trial.id)
        return run_id, trial_config(self.spec, trial, self.root / trial.id, run_id, self.requests[trial.id],
                                    self.search.pruning(drawn) if drawn is not None else None)

    def launch(self, trial: Trial, placement: Placement, holder: str, run_id: str, config: TrialConfig,
               serving: str | None = None, running: str | None = None, started_at: float | None = None) -> None:
        """Submit the trial's task on the placement's devices, leased to `holder`, and count it
        running. A one-device trial starts at once in an idle warm worker, if there is one (its
        task catches up); `running`: the trial whose worker started it already (a take-over)."""
        request = self.requests[trial.id]
        devices = [self.inventory.device(d) for d in placement.device_ids]
        if self.sampler is not None and self.pool is None:  # it reads this host's devices
            self.sampler.watch(run_id, devices, trial.id)
        elastic = request.min_devices < request.max_devices
        update_record(self.root / trial.id, state="starting", devices=list(placement.device_ids))
        started = f" (in the warm worker of {running}, as it ended)" if running else ""
        self.logger.info(f"trial {trial.id} ({trial.label}) starts on {', '.join(placement.device_ids)}{started}")
        warm = self.spec.cluster.warm_workers and not elastic and len(devices) == 1
        timings.mark_first("submitted", f"the first trial submitted ({trial.id})")  # before any process of it can step
        if self.pool is not None:
            nodes = ", ".join(dict.fromkeys(d.node for d in devices))
            node_devices = [d for d in self.inventory.devices if d.node == devices[0].node] if elastic else []
            if elastic:  # the campaign's command folder starts empty: the node relays from sequence 1
                clear_commands(trial_files(self.root / trial.id).control)
                # Its agent's address is this launch's to say: an earlier agent's would start a
                # host (start_host) that waits for a store nobody listens on.
                trial_files(self.root / trial.id).agent_store.unlink(missing_ok=True)
            future = run_remote_trial.with_options(name=f"trial {trial.label} on {nodes}", **self.task_names(trial)).submit(
                config, devices, str(Path.cwd()), self.deployment, self.pool, self.name, elastic, node_devices,
                self.shared_storage, placement.shared_bytes)
        else:
            if warm and not running:
                start_in_idle_worker(plan_launch(config, devices, Path.cwd(), warm=True), config)
            future = run_trial.with_options(name=f"trial {trial.label}", **self.task_names(trial)).submit(
                config, devices, str(Path.cwd()), elastic, warm)
        job = Running(trial, request, devices, holder, run_id, self.root / trial.id, elastic, warm=warm)
        if started_at is not None:  # its worker started it (a take-over) before the loop caught up
            job.started_at = started_at
        if running is None:  # (a take-over's start was noted as it was taken: `taken`)
            self.began[trial.id] = job.started_at
        if self.pool is not None and agent_across_nodes(config, elastic, len(by_node(devices))):
            job.agent_node, job.config = devices[0].node, config  # its agent there grows it onto other nodes in memory
        if serving is not None:
            job.handled.add(serving)
        if stale := pending_request(job.trial_dir, job.handled):  # made for an earlier run of this trial
            job.handled.add(stale.id)
            answer(job.trial_dir, stale.id, "rejected", f"trial {trial.id} restarted on {len(devices)} device(s) before the request was served")
        self.running[future] = job
        self.pending.remove(trial)
        if self.scheduler is not None:
            self.scheduler.running(trial.id, per_node_counts(devices), len(devices), time.time())

    # --- a warm worker handed straight to the next trial (flows/run/handover.py) ----------
    def stage_next(self) -> None:
        """After each running warm trial about to end (or the trials already staged after
        it: short trials end faster than this loop comes round), stage the next one-device
        trial that waits, to start in its worker on its device the moment it ends."""
        if self.pool is not None or self.scheduler is not None or not self.spec.cluster.warm_workers:
            return
        now, ahead = time.time(), stage_ahead_s()
        self.restage_sooner(now)
        typical = statistics.median(self.finished_s) if self.finished_s else None
        chains = []  # per running warm trial: [time left until the last staged after it ends, last, its holder, depth, devices]
        for job in self.running.values():
            if not job.warm:
                continue
            left, last, holder, depth = self.seconds_left(job.trial, job.started_at, now), job.trial, job.holder, 0
            while (staged := self.staged.get(last.id)) is not None:
                if staged.taken_at is not None:  # its worker runs it already (the loop has yet to catch up): the chain's head
                    left, last, holder, depth = self.seconds_left(staged.trial, staged.taken_at, now), staged.trial, staged.holder, 0
                    continue
                last, holder, depth = staged.trial, staged.holder, depth + 1
                left = left + typical if left is not None and typical is not None else None
            chains.append([left, last, holder, depth, job.devices])
        # A search that learns from results (tpe) draws at most one trial ahead per worker, and
        # none after a trial of unknown length; a grid, or a sampler that does not learn, loses
        # nothing by drawing earlier (a pruner that learns from finished trials, the median rule,
        # is told by each trial's trainer as it ends: training.pruning.Pruning.finished).
        learns = self.spec.search is not None and self.spec.search.strategy == "tpe"
        depth = 1 if learns else STAGE_DEPTH
        # One more on the shallowest chain that ends soon, then again: the queue spread over the devices.
        while chains := [c for c in chains if may_stage(c[0], c[3], ahead, depth, unknown=not learns)]:
            chain = min(chains, key=lambda c: staging_order(c[0], c[3]))
            if not self.unstaged_pending():
                self.draw()  # a search draws the trial to stage
            waiting = self.unstaged_pending()
            if not waiting or self.requests[waiting[0].id].max_devices != 1:
                return  # first come, first served: the next in line is not a one-device trial
            staged = self.stage(waiting[0], after=chain[1].id, holder=chain[2], devices=chain[4], scheduled=chain[0] is None)
            chain[0] = chain[0] + typical if chain[0] is not None and typical is not None else None
            chain[1], chain[2], chain[3] = staged.trial, staged.holder, chain[3] + 1
            # Trials this short end faster than the loop opens runs: the next ones' open meanwhile.
            self.opener.ahead(self.unstaged_pending()[:2 * len(chains)], scheduled=typical is None or typical > ahead)

    def unstage_one(self) -> bool:
        """A device is free and nothing waits but staged trials: the one staged last goes back
        to the queue (to start there now), with what was staged after it; False if none could
        (its take-over has begun)."""
        for after, staged in reversed(list(self.staged.items())):
            if staged.taken is None and unstage_successor(after):
                del self.staged[after]
                self.opener.keep(staged.trial.id, staged.run_id, staged.scheduled)
                self.unstage_after(staged.trial.id)
                return True
        return False

    def restage_sooner(self, now: float) -> None:
        """Trials staged after running ones that should now end later than another running
        one with nothing staged after it move there (handover.restage_moves)."""
        heads, jobs = [], {}
        for job in self.running.values():
            staged = self.staged.get(job.trial.id)
            if job.warm and (staged is None or staged.taken is None):  # (a taken one heads its chain: the loop catches up first)
                movable = staged is not None and staged.trial.id not in self.staged  # alone, not the first of a chain
                heads.append((job.trial.id, self.seconds_left(job.trial, job.started_at, now), staged is not None, movable))
                jobs[job.trial.id] = job
        for before, after in restage_moves(heads):
            staged = self.staged[before]
            if not unstage_successor(before):
                continue  # its worker took it meanwhile
            del self.staged[before]
            self.opener.keep(staged.trial.id, staged.run_id, staged.scheduled)
            to = jobs[after]
            self.stage(staged.trial, after=after, holder=to.holder, devices=to.devices, scheduled=staged.scheduled)

    def stage(self, trial: Trial, after: str, holder: str, devices: list[Device], scheduled: bool = False) -> Staged:
        """Stage `trial` after the trial `after` (leased to `holder`) in its warm worker on
        `devices`; `scheduled`: its MLflow run says SCHEDULED until it starts (nothing says when that is)."""
        placement = Placement(trial.id, (devices[0].id,), self.requests[trial.id].at(1).memory_bytes)
        run_id, config = self.prepare(trial, scheduled)
        staged = Staged(trial, placement, self.holder(trial), run_id, config, scheduled=scheduled)
        plan = plan_launch(config, devices, Path.cwd(), warm=True)
        self.staged[after] = staged
        lease = {"db": str(self.store.path), "timeout_s": self.store.heartbeat_timeout_s, "holder": staged.holder, "instead_of": holder,
                 "claims": placement.claims(self.capacity), "capacity": dict(self.capacity), "pid": os.getpid(), "campaign": self.name}
        stage_successor(after, Successor(plan, config, lease, functools.partial(self.take_over, after, self.root / after, holder, staged),
                                         functools.partial(self.adopt, after, holder, staged),
                                         functools.partial(self.heartbeat.release, staged.holder)))
        return staged

    def seconds_left(self, trial: Trial, started_at: float, now: float) -> float | None:
        progress = read_progress(self.root / trial.id)
        step_time = progress.metrics.get("step_time_s") if progress else None
        steps, stop = trial.spec.training.steps, self.spec.early_stopping
        if progress is not None and stop is not None:  # it may be stopped well before its last step
            steps = next_end(progress.step, steps, stop.rule, stop.min_steps, stop.reduction_factor)
        return seconds_left(progress.step if progress else None, steps, step_time, now - started_at, self.finished_s)

    def unstaged_pending(self) -> list[Trial]:
        staged = {s.trial.id for s in self.staged.values()}
        return [t for t in self.pending if t.id not in staged]

    def unstage_after(self, trial_id: str) -> Staged | None:
        """`trial_id` has ended: what was staged after it. When that did not start (its
        take-over did not happen), neither did anything staged after it: back in the queue."""
        unstage_successor(trial_id)
        staged = self.staged.pop(trial_id, None)
        if staged is not None and staged.taken is None:
            self.opener.keep(staged.trial.id, staged.run_id, staged.scheduled)
            self.unstage_after(staged.trial.id)
        return staged

    def take_over(self, ended: str, ended_dir: Path, ended_holder: str, staged: Staged) -> TrialConfig | None:
        """In the ended trial's thread, right after its worker's trial `ended` ended: the
        device's lease moves to the staged trial, which that worker then starts
        (tasks.trial.Successor); None when the ended trial has no result or the device cannot
        be the staged trial's now (another campaign's turn, a busy lease file): it starts
        the usual way then."""
        if completed_result(ended_dir) is None:
            return None
        if not self.heartbeat.pass_on(ended_holder, staged.holder, staged.placement.claims(self.capacity), self.capacity, self.name):
            return None
        return self.taken(ended, staged)

    def adopt(self, ended: str, ended_holder: str, staged: Staged, grant: dict) -> TrialConfig:
        """In the ended trial's thread: its worker moved the device's lease to the staged trial
        itself and started it (tasks/warm_worker.py, `grant`); the campaign holds it from now on."""
        self.store.adopt(staged.holder, grant)
        self.store.forget(ended_holder)
        self.heartbeat.passed(ended_holder, staged.holder)
        return self.taken(ended, staged)

    def taken(self, ended: str, staged: Staged) -> TrialConfig:
        """The device is the staged trial's now: its config with its lease, its allocation logged."""
        staged.taken = dataclasses.replace(staged.config, lease=self.store.fence(staged.holder))
        staged.taken_at = time.time()
        # How long the ended trial took, known now (the loop collects it later): what the
        # staging estimates trials by (finished_s), and when the one after it started.
        self.began[staged.trial.id] = staged.taken_at
        if (began := self.began.pop(ended, None)) is not None:
            self.finished_s.append(staged.taken_at - began)
        log_allocation(self.root, ended, [], "end")
        log_allocation(self.root, staged.trial.id, staged.placement.device_ids, "start",
                       staged.placement.claims(self.capacity)[staged.placement.device_ids[0]])
        return staged.taken

    def draw(self) -> None:
        """A search draws its next trial when none waits (but one staged to start in a warm
        worker: flows/run/handover.py): late draws learn from more results."""
        while self.search is not None and not self.unstaged_pending() and self.search.remaining() > 0:
            drawn = self.search.ask()
            trial = drawn.trial
            active = {t.id for t in self.pending} | {job.trial.id for job in self.running.values()}
            if trial.id in active or trial.id in self.failed:
                # The sampler drew a point that runs now (a small discrete space): one run per id.
                self.search.tell(drawn.number, None)
                self.logger.info(f"trial {trial.id} ({trial.label}) drawn again while it runs: counted, not run twice")
                continue
            self.trials.append(trial)
            done = completed_result(self.root / trial.id)
            if done is not None:  # drawn before (same point, same seed): its result stands
                self.results[trial.id] = done
                self.search.tell(drawn.number, done)
                continue
            try:
                self.requests.update(checked_requests(self.spec, [trial], self.inventory))
            except CampaignError as e:  # this point cannot run (too big, a kwarg the model refuses): the search goes on
                self.failed[trial.id] = str(e)
                self.search.tell(drawn.number, None)
                self.logger.error(f"trial {trial.id} ({trial.label}) cannot run: {e}")
                continue
            self.drawn[trial.id] = drawn
            add_trial_entry(self.spec.tracking.runs_dir, self.name, trial_entry(trial, self.requests[trial.id]))
            self.logger.info(f"search: trial {self.search.drawn()}/{self.search.total} is {trial.id} ({trial.label})")
            self.add_pending(trial)

    def known_trials(self) -> list[Trial]:
        """The campaign's trials: a grid's, or every one its search drew (this run or before),
        with the results of those that ended before this run."""
        if self.search is None:
            return self.trials
        trials = {t.id: t for t in self.trials}
        for drawn in self.search.all_drawn():
            trials.setdefault(drawn.trial.id, drawn.trial)
            if drawn.trial.id not in self.results and (done := completed_result(self.root / drawn.trial.id)) is not None:
                self.results[drawn.trial.id] = done
                if done.get("pruned"):
                    self.pruned.add(drawn.trial.id)
        return list(trials.values())

    def packer(self, multi_node: bool = False) -> Packer:
        """`multi_node`: a gang no node can hold now may spread (a fixed-size trial in a pool)."""
        pending_min = [self.requests[t.id].at(self.requests[t.id].min_devices) for t in self.pending]
        return Packer(self.inventory, self.store.usage(), workload=workload_of(pending_min), multi_node=multi_node)

    def start_first_come(self) -> None:
        """Fixed-size trials: each in order, at the largest size that leaves the queue room.
        A search draws one trial at a time (draw): while the last draw started, the next is
        drawn for the devices still free now, not a round of the loop later (the loop's wait,
        CONTROL_POLL_S, left the second device of a search's start idle for half a second)."""
        while self._start_pending() and self.search is not None and not self.unstaged_pending() and self.search.remaining() > 0:
            self.draw()

    def _start_pending(self) -> bool:
        """Start the waiting trials that fit now; whether any did."""
        packer = self.packer(multi_node=self.pool is not None)
        if self.staged and not self.unstaged_pending() and any(packer.free_bytes(d.id) == d.memory_bytes for d in self.inventory.devices):
            self.unstage_one()
        started = False
        for trial in self.unstaged_pending():
            request = self.requests[trial.id]
            queued_min = sum(self.requests[t.id].min_devices for t in self.pending if t is not trial)
            free = sum(packer.free_bytes(d.id) == d.memory_bytes for d in self.inventory.devices)
            placement = start_size(request, lambda n: packer.place(request.at(n)), queued_min, free)
            if placement is None:
                continue
            if self.start(trial, placement):
                started = True
            else:
                packer.release(placement)
        return started

    def schedule_elastic(self) -> None:
        """Elastic trials: the policy decides who runs on how many devices, now."""
        now = time.time()
        for job in self.running.values():
            progress = read_progress(job.trial_dir)
            metrics = progress.metrics if progress else {}
            if progress and progress.world_size == len(job.devices) and "step_time_s" in metrics:
                # The policy compares sizes by time per reference step (the trial's batch_size
                # samples): a goodput trial's step at another size trains another batch.
                batch = progress.batch_size or job.trial.spec.training.batch_size
                per_reference_step = metrics["step_time_s"] * job.trial.spec.training.batch_size / batch
                self.scheduler.observe(job.trial.id, len(job.devices), per_reference_step, nodes=len(per_node_counts(job.devices)))
            if progress:
                self.scheduler.progressed(job.trial.id, job.trial.spec.training.steps - progress.step)
            if noise := metrics.get("grad_noise_scale"):  # samples, measured by the trainer
                self.scheduler.observe_noise(job.trial.id, noise / job.trial.spec.training.batch_size)
            if (pause := self.resize_pauses.latest(job.trial_dir)) is not None:  # as its trainer timed it
                self.scheduler.observe_pause(job.trial.id, pause)
            self.scheduler.running(job.trial.id, per_node_counts(job.devices), len(job.devices), now)
            if job.pinned_by_person:
                self.scheduler.pin(job.trial.id, len(job.devices))
        ours = f"{self.name}/"
        foreign = {lease.device_id for lease in self.store.leases() if not lease.holder.startswith(ours)}
        # Every trial of a grid has arrived at the start; a search may still draw more.
        more_to_come = self.search is not None and bool(self.search.remaining())
        actions = self.scheduler.decide(usable_devices(self.inventory, foreign), now, more_to_come)
        for job in self.running.values():
            target = actions.resize.get(job.trial.id)
            if target is not None and job.awaiting is None and job.hosting is None and pending_request(job.trial_dir, job.handled) is None:
                self.choose_batch(job.trial, job.trial_dir, target, actions.batch.get(job.trial.id))
                request_resize(job.trial_dir, target, by="policy")  # served like a person's, in serve_resizes
        packer = self.packer(multi_node=self.pool is not None)  # in a pool the policy may start a trial across nodes
        for trial in [t for t in self.pending if t.id in actions.start]:
            self.choose_batch(trial, self.root / trial.id, actions.start[trial.id], actions.batch.get(trial.id))
            placement = packer.place(self.requests[trial.id].at(actions.start[trial.id]))
            if placement is not None and not self.start(trial, placement):
                packer.release(placement)

    def start_host(self, job: Running, node: str, devices: list[Device], seq: int) -> str | None:
        """The host segment of `job` on `node` (flows.pool.remote.start_host); None when its agent
        has not said where its store listens yet."""
        published = read_agent_store(job.trial_dir)
        if published is None or job.config is None:
            return None
        memory = job.request.at(len(job.devices)).memory_bytes  # at its size now: no less than it needs grown (less batch each)
        run = start_host(job.config, node, devices, [d for d in self.inventory.devices if d.node == node], str(Path.cwd()),
                         self.deployment, self.pool, self.name, published.endpoint, seq, self.shared_storage,
                         None if memory == WHOLE_DEVICE else memory)
        if run is not None:
            self.logger.info(f"trial {job.trial.id}: starting its host on {node} for {', '.join(d.id for d in devices)}")
        return run

    def task_names(self, trial: Trial) -> dict[str, Any]:
        """A trial's task run is found in Prefect by its id (its name), and by its campaign's tag.
        Not a tag of its own: Prefect starts a client (TLS context included, ~0.1 s of CPU)
        for each new set of tags a task run's concurrency limits are looked up by."""
        return {"task_run_name": trial.id, "tags": {f"campaign:{self.name}"}}

    def choose_batch(self, trial: Trial, trial_dir: Path, devices: int, scale: float | None) -> None:
        """A goodput trial with max_batch_size trains its next size at the batch the policy
        chose for goodput (`scale` x batch_size): the trainer reads it when it attaches."""
        t = trial.spec.training
        if scale is None or t.scaling != "goodput" or not t.max_batch_size:
            return
        batch_choice_now(devices, min(t.max_batch_size, round(scale * t.batch_size)), scale).write(trial_dir)

    # --- running trials --------------------------------------------------------------
    def serve(self) -> None:
        for job in self.running.values():
            before = job.device_ids
            if line := serve_resizes(job, self.inventory, self.store, self.capacity, recall if self.pool else None, self.hosts):
                self.logger.info(line)
            if job.device_ids != before:
                log_allocation(self.root, job.trial.id, job.device_ids, "resize")
                if self.sampler is not None:
                    self.sampler.watch(job.run_id, job.devices)

    def lease_lost(self, holder: str) -> None:
        """The heartbeat found a trial's leases reclaimed: its processes stop now (the devices
        may be another campaign's); `collect` queues it again."""
        trial_id = trial_of(holder)
        self.logger.error(f"trial {trial_id}: its leases were reclaimed; stopping it, it resumes from its checkpoint on devices leased again")
        revoke(trial_id)

    def collect(self, future: PrefectFuture) -> None:
        job = self.running.pop(future)
        # A trial shorter than its sampling period gets one sample of its devices as it ends:
        # written with its run's close when it closes here, else alone.
        reading = self.sampler.forget(job.run_id) if self.sampler is not None else None
        if not self.collected(future, job, reading) and reading is not None:
            self.sampler.log_reading(job.run_id, reading)

    def collected(self, future: PrefectFuture, job: Running, reading: dict | None) -> bool:
        """Whether the trial's run was closed (with `reading`)."""
        staged = self.unstage_after(job.trial.id)
        if staged is not None and staged.taken is not None:  # its worker started the staged trial: the loop catches up
            self.launch(staged.trial, staged.placement, staged.holder, staged.run_id, staged.taken, running=job.trial.id,
                        started_at=staged.taken_at)
            if staged.scheduled:
                mark_running(self.uri, staged.run_id)
        else:  # (else the take-over passed its devices on)
            self.heartbeat.release(job.holder)
        if self.scheduler is not None:
            self.scheduler.running(job.trial.id, job.devices[0].node, 0, time.time())
        lease_lost = readmit(job.trial.id)
        if self.pool is not None:
            forget_recall(job.trial.id)
        try:
            result = future.result()
            reason = "node lost" if result.get("node_lost") else "preempted" if result.get("preempted") else "end"
            if staged is None or staged.taken is None:  # else the take-over said it
                log_allocation(self.root, job.trial.id, [], "moving" if reason == "preempted" and job.relaunch else reason)
        except Exception as e:
            self.relaunch_failed(job, f"it stopped on {', '.join(job.device_ids)} with an error")
            if lease_lost:  # stopped because its leases were reclaimed, not its own failure: queued again
                log_allocation(self.root, job.trial.id, [], "lease lost")
                self.requeue(job)
                return False
            log_allocation(self.root, job.trial.id, [], "failed")  # the task failed after its retries: record it, go on with the rest
            self.failed[job.trial.id] = str(e)
            if job.trial.id in self.drawn:
                self.search.tell(self.drawn.pop(job.trial.id).number, None)
            close_trial_run(self.uri, job.run_id, None, job.device_ids, error=str(e), log_path=str(trial_files(job.trial_dir).log),
                            reading=reading)
            # One line, the failure's own (an exception's last line, a signal, a full disk): not a
            # cut from the middle of a traceback; the whole of it is in the trial's train.log.
            self.logger.error(e.summary if isinstance(e, TrialFailed) else f"trial {job.trial.id} failed: {str(e)[-2000:]}")
            if self.scheduler is not None:
                self.scheduler.finish(job.trial.id)
            return True
        if node := result.get("node_lost"):  # the node is gone, the trial is not: it resumes from its checkpoint on the nodes left
            self.relaunch_failed(job, f"node {node} was lost first")
            self.logger.error(f"trial {job.trial.id}: node {node} stopped beating; it resumes from its last checkpoint on the nodes left")
            self.drop_node(node)
            self.requeue(job)
            self.check_pending_fit()
            return False
        if result.get("preempted") and job.relaunch is not None:
            self.relaunch(job)
            return False
        if stalled := result.get("stalled"):  # a resize that hung (tasks/trial.py run_plan): not a preemption anyone asked for
            self.logger.error(f"trial {job.trial.id} {stalled}: stopped; it resumes from its checkpoint")
            if job.awaiting is not None:
                answer(job.trial_dir, job.awaiting[2], "rejected", f"trial {job.trial.id} {stalled}: stopped; it resumes from "
                       "its checkpoint where the scheduler places it")
            self.requeue(job)  # unpinned: a person's size did not hold
            return False
        if result.get("preempted"):
            self.logger.info(f"trial {job.trial.id} preempted: its devices are free, it resumes from its checkpoint later")
            self.pending.append(job.trial)
            if job.awaiting is not None:  # the resize to 0 is done when the trial has stopped: answer it now
                answer(job.trial_dir, job.awaiting[2], "applied", f"preempted: its devices are free; it resumes from its "
                       f"checkpoint when {'the rest of the campaign is done' if job.pinned_by_person else 'devices free up'}")
            if self.scheduler is not None:
                # A person's preemption parks the trial: the policy leaves it be while other trials
                # want the devices, and it resumes when nothing else does (see run).
                if job.pinned_by_person:
                    self.scheduler.pin(job.trial.id, 0)
                else:
                    self.scheduler.unpin(job.trial.id)
            return False
        self.results[job.trial.id] = result
        if (began := self.began.pop(job.trial.id, None)) is not None:  # (else counted as its worker passed its device on)
            self.finished_s.append(time.time() - began)
        if job.relaunch is not None:
            answer(job.trial_dir, job.relaunch[1], "finished", f"trial {job.trial.id} finished on {', '.join(job.device_ids)} before it could move")
        if job.awaiting is not None:  # it reached its end with a resize asked: say whether that landed first
            seq, devices, request_id = job.awaiting
            state = read_agent_state(trial_files(job.trial_dir).control)
            if resize_landed(state, seq, devices):
                # (its short rest of training ended before this loop read the agent's "running")
                answer(job.trial_dir, request_id, "applied", f"now on {', '.join(sorted(state.devices))}; it finished there")
            else:
                answer(job.trial_dir, request_id, "finished",
                       f"trial {job.trial.id} finished on {', '.join(job.device_ids)} before the resize could happen")
            job.awaiting = None
        if self.scheduler is not None:
            self.scheduler.finish(job.trial.id)
        if job.trial.id in self.drawn:
            self.search.tell(self.drawn.pop(job.trial.id).number, result)
        close_trial_run(self.uri, job.run_id, result, job.device_ids, log_path=str(trial_files(job.trial_dir).log), reading=reading)
        if result.get("pruned"):  # early stopping: its devices are free for the others now
            self.pruned.add(job.trial.id)
            update_record(job.trial_dir, state="pruned")
            self.logger.info(f"trial {job.trial.id} pruned at step {result['steps']}: {format_metrics(result['metrics'])}")
        else:
            self.logger.info(f"trial {job.trial.id} finished: {format_metrics(result['metrics'])}")
        return True

    def relaunch(self, job: Running) -> None:
        """A trial stopped to move onto other nodes (or off them, `Running.relaunch`) starts
        again at once on the devices its resize chose, from the checkpoint it stopped at."""
        devices, request_id = job.relaunch
        self.pending.append(job.trial)
        placement = Placement(job.trial.id, tuple(d.id for d in devices), job.request.at(len(devices)).memory_bytes)
        if not self.start(job.trial, placement, serving=request_id):
            answer(job.trial_dir, request_id, "rejected", f"trial {job.trial.id} stopped to move, and a device of "
                   f"{', '.join(placement.device_ids)} was taken meanwhile: it starts again where the scheduler places it")
            return
        moved = next(j for j in self.running.values() if j.trial.id == job.trial.id)
        moved.pinned_by_person = job.pinned_by_person
        nodes = ", ".join(dict.fromkeys(d.node for d in devices))
        answer(job.trial_dir, request_id, "applied", f"now on {', '.join(placement.device_ids)} (nodes {nodes})")
        self.logger.info(f"trial {job.trial.id} moved to {len(devices)} device(s) on {nodes}")

    def relaunch_failed(self, job: Running, why: str) -> None:
        if job.relaunch is not None:
            answer(job.trial_dir, job.relaunch[1], "rejected", f"trial {job.trial.id} did not move: {why}")

    def requeue(self, job: Running) -> None:
        """A trial stopped through no fault of its own (node or leases lost) waits to start again."""
        self.pending.append(job.trial)
        if self.scheduler is not None:
            # A person's size was for the devices it lost: the policy places it again (a
            # pinned trial is never started by the policy, so it would wait forever).
            self.scheduler.unpin(job.trial.id)

    def look_at_pool(self) -> None:
        """A node that joined the pool (or came back) offers its devices from now on; a dead one
        that runs nothing of ours is dropped. A dead node's running trials are its segments'
        to report (`node_lost`), which drops the node then."""
        if self.pool is None or time.time() < self.next_pool_look:
            return
        self.next_pool_look = time.time() + POOL_LOOK_S
        try:
            nodes = pool_nodes(self.pool)
        except PoolError as e:  # the server may be back at the next look; running trials go on meanwhile
            self.logger.warning(f"could not read pool {self.pool}: {e}")
            return
        if server_trouble_within(NODE_GRACE_S):
            return  # just back from not answering: the nodes have not beaten again yet
        live = {n.name: n for n in nodes if n.live}
        for name, node in live.items():
            if name not in self.inventory.nodes and node.inventory.devices:
                self.inventory = Inventory(self.inventory.devices + node.inventory.devices, {**self.inventory.links, **node.inventory.links})
                self.capacity |= {d.id: d.memory_bytes for d in node.inventory.devices}
                self.logger.info(f"node {name} joined pool {self.pool}: {len(node.inventory.devices)} device(s) more, "
                                 f"{len(self.inventory.devices)} on {len(self.inventory.nodes)} node(s)")
        busy = {d.node for job in self.running.values() for d in job.devices}
        for name in self.inventory.nodes:
            if name not in live and name not in busy and len(self.inventory.nodes) > 1:
                self.drop_node(name)
                self.check_pending_fit()

    def drop_node(self, node: str) -> None:
        """A pool node stopped beating: nothing more is placed on its devices."""
        if node not in self.inventory.nodes:
            return
        kept = tuple(d for d in self.inventory.devices if d.node != node)
        self.inventory = Inventory(kept, {pair: link for pair, link in self.inventory.links.items()
                                          if all(self.inventory.device(d).node != node for d in pair)})
        self.capacity = {d.id: d.memory_bytes for d in kept}
        if not kept:
            raise PoolError(f"every node of pool {self.pool} stopped beating: `campaign launch` again, once nodes run "
                            f"`campaign worker --pool {self.pool}`, resumes the trials from their checkpoints")
        self.logger.warning(f"node {node} left the pool: {len(kept)} device(s) on {len(self.inventory.nodes)} node(s) remain")

    def check_pending_fit(self) -> None:
        """After a node left: every waiting trial still fits the nodes left (else it would wait forever)."""
        try:
            check_fits([self.requests[t.id].at(self.requests[t.id].min_devices) for t in self.pending], self.inventory,
                       multi_node=self.pool is not None)
        except CampaignError as e:
            raise PoolError(f"the nodes left in pool {self.pool} cannot run every trial: {e}. Start `campaign worker --pool "
                            f"{self.pool}` on more nodes and `campaign launch` again: the trials resume from their checkpoints") from None

    def run(self) -> None:
        ended = False
        busy_tries = 0  # rounds in a row that found the lease file locked
        # A pool's trials run elsewhere and keep sinks of their own.
        hub = open_metrics_hub() if self.pool is None else None
        if self.pending or self.search is not None:
            import_drawing_early()
        try:
            while self.pending or self.running or (self.search is not None and self.search.remaining()):
                try:
                    self.step()
                    busy_tries = 0
                except LeaseStoreBusy as e:
                    self.wait_out_busy(e, busy_tries)
                    busy_tries += 1
            ended = True
        finally:
            # On any error here (a full lease database, a lock held past our leases...) the
            # trials' processes stop before their leases are given back: no device to two trials.
            if stopped := stop_launched_trials():
                self.logger.warning(f"stopped {len(stopped)} running trial(s) before releasing their devices: {', '.join(stopped)}")
            close_warm_workers()
            self.opener.close()
            if hub is not None:  # every trial's process has exited: the hub sends the rest while the summary is written
                end_metrics_hub()
            self.heartbeat.close()
            if self.sampler is not None:
                self.sampler.close()
            if self.waiting_since is not None:
                try:
                    self.store.stop_waiting(self.name)
                except LeaseStoreBusy as e:  # the entry dies with this process (its pid) anyway
                    self.logger.warning(f"could not withdraw from the device queue: {e}")
            if not ended:
                self.record_stop()

    def step(self) -> None:
        """One round of the loop: start what can start, serve resizes, collect what ended."""
        self.heartbeat.release_pending()
        self.look_at_pool()
        self.draw()
        if self.scheduler is not None:
            self.schedule_elastic()
        else:
            self.start_first_come()
            self.stage_next()
        self.queue_for_devices()
        if not self.running:
            if self.scheduler is not None and self.scheduler.unpin_parked():
                self.logger.info("nothing else of the campaign runs: trials preempted by hand resume")
                return
            if self.pending:  # every device we could use is leased by someone else
                time.sleep(WAIT_FOR_DEVICES_S)
            return
        future = first_finished(list(self.running), CONTROL_POLL_S)
        if future is None:
            self.serve()
            return
        self.collect(future)

    def wait_out_busy(self, error: LeaseStoreBusy, tries: int) -> None:
        """The lease file stayed locked (another process's long transaction, a slow disk):
        running trials go on under their leases, which are valid until the heartbeat's
        deadline; the loop tries again after a growing pause, and gives up (stopping its
        trials first, in `run`) only when its leases would expire before the next try."""
        pause = min(BUSY_BACKOFF_S[0] * 2 ** min(tries, 10), BUSY_BACKOFF_S[1])
        if time.time() + pause >= self.heartbeat.deadline:
            raise LeaseStoreBusy(f"{error}; this campaign's leases expire at {time.strftime('%H:%M:%S', time.localtime(self.heartbeat.deadline))}"
                                 ": its trials were stopped; `campaign launch` again resumes them from their checkpoints") from error
        self.logger.warning(f"the lease database is locked ({error}); running trials go on, trying again in {pause:.1f} s")
        # Meanwhile a trial that ends is collected as usual: recorded finished, its MLflow run
        # closed (its devices go back once the file frees: LeaseHeartbeat.release_pending).
        until = time.time() + pause
        while (left := until - time.time()) > 0:
            if not self.running:
                time.sleep(left)
                break
            if (future := first_finished(list(self.running), left)) is not None:
                self.collect(future)

    def queue_for_devices(self) -> None:
        """While trials wait, other campaigns' new trials give way to this one in turn
        (LeaseStore.acquire): refreshed well within the lease timeout."""
        now = time.time()
        if self.pending and (self.waiting_since is None or now - self.waiting_since > self.store.heartbeat_timeout_s / 4):
            self.store.wait_turn(self.name)
            self.waiting_since = now
        elif not self.pending and self.waiting_since is not None:
            self.store.stop_waiting(self.name)
            self.waiting_since = None

    def record_stop(self) -> None:
        """The campaign stops early: its records and MLflow runs say so (stopped, KILLED), not 'running'."""
        for job in self.running.values():
            update_record(job.trial_dir, state="stopped")
        update_campaign(self.spec.tracking.runs_dir, self.name, state="stopped", ended=time.time())
        try:
            staged = [s.run_id for s in self.staged.values()]  # opened ahead of a start that did not come
            mark_killed(self.uri, [job.run_id for job in self.running.values()] + staged + [self.parent_run_id])
        except Exception as e:  # the tracking server may be what failed
            self.logger.error(f"could not mark the MLflow runs KILLED ({e.__class__.__name__}: {e})")


def flow_run_name() -> str:
    """`<campaign> · launch <n>`: a campaign's runs, told apart in Prefect's list (n counts
    the launches recorded in its campaign.json, this one included)."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    try:
        spec = load_spec(params.get("params_path", "params.yaml"), pool=params.get("pool"))
        record = read_campaign(spec.tracking.runs_dir, spec.campaign.name)
        return f"{spec.campaign.name} · launch {(record.launches if record else 0) + 1}"
    except Exception:  # the flow itself says what is wrong with the spec, with its field
        return "campaign"


@flow(name="campaign", flow_run_name=flow_run_name, log_prints=True)
def campaign_flow(params_path: str = "params.yaml", lease_db: str | None = None, pool: str | None = None) -> dict[str, Any]:
    timings.mark("the flow run started")
    with heartbeats():  # where the launch took them from Prefect's engine (flows/run/heartbeat.py)
        return run_campaign(params_path, lease_db, pool)


def run_campaign(params_path: str, lease_db: str | None, pool: str | None) -> dict[str, Any]:
    """The campaign flow's body: its trials run, its records and pictures written."""
    logger = CampaignLog(get_run_logger())
    spec = load_spec(params_path, pool=pool)
    check_data(spec)
    name, uri = spec.campaign.name, tracking_uri(spec.tracking)
    inventory = inventory_for(spec)
    # A search draws its trials as it goes; what it drew before a kill runs again (resumes), and
    # so does one told ended whose result is now refused or gone: the study's tell stands, the
    # trial is re-finalised from its last checkpoint (training.result), as a grid's would be.
    root = campaign_dir(spec.tracking.runs_dir, name)
    search = Search(spec, root) if spec.searched else None
    if search is None:
        trials = expand_grid(spec)
    else:
        trials = [d.trial for d in search.unfinished()]
        trials += [d.trial for d in search.ended() if completed_result(root / d.trial.id, warn=lambda _: None) is None]
    requests = checked_requests(spec, trials or expand_grid(spec), inventory)  # a request no node can hold fails now

    if spec.cluster.pool is None:  # its MLflow calls run there (a pool's trials run elsewhere, with sinks of their own)
        open_metrics_hub(store=uri)
    varies = spec.grid if search is None else {k: str(v.model_dump()) for k, v in (spec.search.space.items() if spec.search else [])}
    parent_run_id = open_campaign_run(uri, spec.tracking.experiment, name, varies, search.total if search else len(trials))
    timings.mark("the campaign's MLflow run open")
    ui, experiment = mlflow_ui(uri), run_experiment(uri, parent_run_id)
    # The view the links open (the live view's, the summary's, `campaign ui`'s): its trials as rows, best first.
    save_campaign_view(uri, experiment, name, *ranked_by(spec), varied_params(spec))
    before = read_campaign(spec.tracking.runs_dir, name) or CampaignRecord(name=name)  # a search's trials so far
    write_campaign(spec.tracking.runs_dir, dataclasses.replace(
        before, launches=before.launches + 1, params=str(Path(params_path).resolve()), mlflow_run_id=parent_run_id,
        owner=process_identity(), state="running", started=time.time(), ended=None,
        # A server that lives as long as this launch is not one to come back to.
        prefect_api=os.environ.get("PREFECT_API_URL") if os.environ.get("PREFECT_API_URL") != os.environ.get("CAMPAIGN_PREFECT_TEMPORARY") else None,
        # Where people look: the live view prints these links (flows/run/live_view.py: campaign_links).
        flow_run_id=str(prefect_flow_run.id) if prefect_flow_run.id else None,
        mlflow_ui=ui, mlflow_experiment_id=experiment, objective=ranked_by(spec),
        trials=before.trials if search else tuple(trial_entry(t, requests[t.id]) for t in trials),
    ))
    run = CampaignRun(spec, trials, inventory, requests, parent_run_id, lease_db, logger, search)
    run.run()
    timings.mark("the trials ended, their workers closed")

    known = run.known_trials()
    summary = write_summary(spec, known, run.results, run.failed, run.pruned)
    close_campaign_run(uri, parent_run_id, summary)
    update_campaign(spec.tracking.runs_dir, name, state="ended", ended=time.time())
    timings.mark("the summary written, the campaign's MLflow run closed")
    states = {t.id: trial_status(run.root / t.id, t.id, t.label, t.spec.training.steps).state for t in known}
    try:  # the trials' results are on disk and in MLflow; a Prefect server gone now must not fail them
        if ui and run.run_ids:  # where to see the trials' curves side by side, the campaign's metric first
            logger.info(f"MLflow compare {campaign_view_url(ui, experiment, name, charts=True)}")
        create_markdown_artifact(summary_markdown(name, summary, known, states, run.run_ids, ui, experiment), key=summary_key(name),
                                 description=f"campaign {name}: its trials, states, metrics and MLflow runs")
        if rows := timeline_rows(intervals(read_allocations(run.root))):
            create_table_artifact(rows, key=f"{summary_key(name)}-timeline",
                                  description=f"campaign {name}: who held which device when (seconds since the first start)")
    except Exception as e:
        logger.warning(f"the campaign's Prefect artifacts could not be saved ({e.__class__.__name__}: {e})")
    timings.mark("the summary's Prefect artifacts saved")
    try:  # pictures must not fail a campaign that trained
        if pictures := write_timeline(run.root, f"campaign {name}: who held which device"):
            log_files(uri, parent_run_id, list(pictures), "timeline")
        timings.mark("the timeline drawn")
        labels = {t.id: t.label for t in known}
        drain_metrics_hub()  # the trials' metrics are all in MLflow now
        timings.mark("the trials' metrics all in MLflow")
        if curves := campaign_curves(uri, run.run_ids, labels, f"campaign {name}", run.root / "curves.png"):
            log_files(uri, parent_run_id, [curves], "curves")
    except Exception as e:
        logger.warning(f"the campaign's pictures could not be drawn ({e.__class__.__name__}: {e})")
    timings.mark("the curves drawn")
    close_metrics_hub()  # where the pictures failed first
    if run.failed:
        raise RuntimeError(f"{len(run.failed)} of {len(trials)} trials failed: {', '.join(run.failed)}; see `campaign status {name}`")
    return summary
