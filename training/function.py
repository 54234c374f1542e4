"""A trial that runs the researcher's own training function instead of the project's loop.

    training:
      target: mypkg.train:main      # def main(ctx, **kwargs): ...
      kwargs: {hidden: 64}          # grid- and search-able as training.kwargs.hidden

The function runs in every process of the trial (torchrun's, a warm worker's or an elastic
generation's) with the process group already initialised, the device chosen and the seed
set, and gets one `TrialContext`:

- `ctx.config` (the trial's whole spec, grid or search values merged), `ctx.rank`,
  `ctx.world_size`, `ctx.local_rank`, `ctx.device`, `ctx.steps`, `ctx.trial_id`;
- `ctx.report(step, **metrics)`: rank 0's values go to MLflow (through the same batched
  sink as the project's loop: a replayed step is not logged twice), `progress.json` (the
  live table, `campaign status`, the scheduler) and the pruner; other ranks' are dropped;
- `ctx.save(step, state)` / `ctx.load() -> (step, state) | None`: sharded DCP checkpoints in
  the trial's folder with the same manifest, signature, lease fence, retention and DVC
  tracking as the project's loop. Modules, optimizers, LR schedulers and grad scalers in
  `state` are saved as their state dicts (a DDP or compiled wrapper unwrapped), so `load`
  gives back plain dicts to `load_state_dict`, with their whole shape: an empty container
  (an optimizer's `state` before its first step) comes back too; a save is written in the
  background and is durable before the trial is said finished;
- `ctx.should_stop()`: True when the trial is to end now (the pruner stopped it, the
  campaign wants its devices for a resize or preemption, or it is stopping: SIGTERM). Every rank calls it at the same
  points (it agrees rank 0's answer over a CPU group: no device sync); the function then
  saves and returns, and the campaign restarts it at its new size from that save (a pruned
  trial is final: its save after the stop writes nothing, the last one stands).

A function trial is elastic by checkpoint-restart: its agent always takes the restart path
(training/elastic.py), where the project's loop hands its state over in memory.

What the function returns, if a dict of numbers, is merged into the trial's final metrics.
An exception ends the trial with the traceback in its train.log (the campaign goes on).
"""

from __future__ import annotations

import inspect
import json
import math
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from training.batches import Phase
from training.checkpoint import Checkpointer
from training.checkpoint_remote import remote_for
from training.progress import progress_now
from training.config import TrialConfig
from training.errors import CampaignError
from training.fence import commit_guard, grant_of
from training.result import write_result
from training.layout import trial_files
from training.metrics import MetricsLogger, progress_line
from training.pruning import Pruning
from training.workload import WorkloadError, import_target

TARGET_FIELD = "training.target"
PROGRESS_EVERY_S = 1.0  # progress.json and the train.log line, at most this often (an evaluation always)
HOLD_POLL_S = 0.02


class FunctionError(CampaignError):
    """The training function cannot be called as the spec says."""


def load_function(function: dict[str, Any], field: str = TARGET_FIELD) -> Callable:
    """The user's function, checked to accept (ctx, **kwargs); a FunctionError names the field."""
    try:
        fn = import_target(function["target"], field)
    except WorkloadError as e:
        raise FunctionError(str(e)) from None
    kwargs = function.get("kwargs") or {}
    try:
        signature = inspect.signature(fn)
    except ValueError:
        return fn
    try:
        signature.bind(object(), **kwargs)
    except TypeError as e:
        raise FunctionError(f"{field}: {function['target']} must take the trial context as its one positional argument, then "
                            f"training.kwargs {sorted(kwargs)} as keywords: {e}") from None
    return fn


# Objects a save stores as their state dicts: what `load_state_dict` takes back.
STATEFUL = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)


def _plain(value: Any) -> Any:
    """What a checkpoint stores of a value: a module's, an optimizer's, an LR scheduler's or a
    grad scaler's state dict (a module's wrappers unwrapped, so the keys do not depend on DDP
    or torch.compile), else the value itself; inside dicts and lists too."""
    if isinstance(value, nn.Module):
        while hasattr(value, "module") and isinstance(value.module, nn.Module):  # DDP
            value = value.module
        value = getattr(value, "_orig_mod", value)  # torch.compile
        return value.state_dict()
    if isinstance(value, STATEFUL):
        return value.state_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# --- the state's shape, kept apart from its leaves -------------------------------------------
#
# DCP flattens a state into its leaves and rebuilds the nesting from them, so a container
# without leaves is lost: an optimizer's `state` before its first step (or, for plain SGD,
# always) came back without its key, and `load_state_dict` raised KeyError: 'state'; an
# empty dict in a list was dropped, shifting the list (or made the load fail). So a save
# hands DCP only a flat dict of leaves (tensors and plain values), and a JSON record of the
# nesting (dicts with their keys, ints kept ints, and lists) that `load` rebuilds exactly.

def _split(value: Any, leaves: dict[str, Any]) -> Any:
    """The nesting of `value` as JSON (a leaf: its number in `leaves`, where it is put)."""
    if isinstance(value, dict):
        return {"dict": [[_key_record(k), _split(v, leaves)] for k, v in value.items()]}
    if isinstance(value, list):
        return {"list": [_split(v, leaves) for v in value]}
    index = len(leaves)
    leaves[str(index)] = value  # a tensor, a number, a string, None, a tuple (DCP keeps a tuple whole)
    return index


def _key_record(key: Any) -> list:
    if isinstance(key, int) and not isinstance(key, bool):
        return ["int", key]  # an optimizer's parameter indices: back as ints, as load_state_dict wants them
    return ["str", str(key)]  # any other key as DCP itself kept it: its text


def _join(shape: Any, leaves: dict[str, Any]) -> Any:
    """The value `_split` took apart."""
    if isinstance(shape, int):
        return leaves[str(shape)]
    if "dict" in shape:
        return {(key if kind == "int" else str(key)): _join(child, leaves) for (kind, key), child in shape["dict"]}
    return [_join(child, leaves) for child in shape["list"]]


def _restore_optimizer_keys(value: Any) -> Any:
    """A checkpoint written before saves kept their shape: DCP brings an optimizer's `state`
    back keyed by strings ('0'); Optimizer.load_state_dict wants the parameter indices as ints."""
    if isinstance(value, dict):
        if "param_groups" in value and isinstance(value.get("state"), dict):
            value = {**value, "state": {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in value["state"].items()}}
        return {k: _restore_optimizer_keys(v) for k, v in value.items()}
    return value


def checkpoint_state(step: int, state: dict[str, Any]) -> dict[str, Any]:
    """What `ctx.save` hands DCP for `state` at `step`: its leaves, flat, and its shape."""
    leaves: dict[str, Any] = {}
    shape = _split(_plain(state), leaves)
    return {"leaves": leaves, "shape": json.dumps(shape), "progress": {"step": step}}


def state_of_checkpoint(loaded: dict[str, Any]) -> dict[str, Any]:
    """The state `checkpoint_state` was given, from what DCP loaded of it."""
    if "shape" not in loaded:  # written before saves kept their shape: DCP's own nesting
        return _restore_optimizer_keys(loaded["app"])
    # A state of empty containers only has no leaves, and DCP keeps no `leaves` then.
    return _join(json.loads(loaded["shape"]), loaded.get("leaves", {}))


class TrialContext:
    """What the user's function gets: the trial's settings and its four calls."""

    def __init__(self, cfg: TrialConfig, rank: int, world_size: int, local_rank: int, device: torch.device,
                 stop_requested: Callable[[], bool] | None = None, async_saves: bool = True, quiet: bool = False):
        self.cfg = cfg
        self.config: dict[str, Any] = dict(cfg.point or {})
        self.trial_id, self.steps = cfg.trial_id, cfg.steps
        self.rank, self.world_size, self.local_rank, self.device = rank, world_size, local_rank, device
        self._stop_requested = stop_requested  # rank 0: the campaign wants the devices (an elastic generation's stop file)
        self.is_rank0 = rank == 0
        self.quiet = quiet  # a dry run (check_function): nothing to train.log or the flow's log
        self.latest: dict[str, float] = {}
        self.step = 0  # the latest step reported or saved: the trial's progress
        self.progress_state = "running"  # the state last written to progress.json (a test's hold puts it back)
        self.started_step: int | None = None  # the step the function resumed from (load), if it did
        self.pruned = False
        self.stopped = False  # should_stop said yes for a reason other than pruning
        self.last_step_at: float | None = None
        self.saved: Path | None = None
        self.reports = 0
        self.on_first_report: Callable[[], None] | None = None
        self._calls = 0
        self.terminated = False  # SIGTERM (the campaign is stopping): should_stop says so, the function saves and returns
        self._agreed = False  # should_stop's answer, once every rank agreed it is yes
        self._printed_at = self._progress_at = 0.0
        self._timing: tuple[int, float] | None = None  # (step, time) of the previous report: step time
        # Measured between reports: what progress.json says, whatever the function reports
        # under that name itself (the watchdog's limit and the scheduler's speed are made of it).
        self.step_time_s: float | None = None
        # Rank 0's pruning decision and stop requests reach the others over gloo on the CPU:
        # agreeing costs no device sync, wherever the model trains.
        self._flags = dist.new_group(backend="gloo") if world_size > 1 else None
        # Saves written from a thread need collectives of their own (as the project's loop's do);
        # a process alone writes without (a new group is a gloo setup at each warm trial's start).
        background = async_saves and dist.is_initialized()
        self._async = dist.new_group(backend="gloo") if background and world_size > 1 else None
        self.checkpointer = Checkpointer(cfg.checkpoint_dir, cfg.keep_checkpoints, rank, world_size, self._async,
                                         guard=commit_guard(cfg.lease), grant=grant_of(cfg.lease),
                                         remote=remote_for(cfg.checkpoint_remote, cfg.keep_checkpoints), background=background)
        self.metrics = (MetricsLogger(cfg.mlflow_tracking_uri, cfg.mlflow_run_id, journal=trial_files(cfg.trial_dir).metrics_journal)
                        if self.is_rank0 else MetricsLogger(None, None))
        self.pruning = Pruning(cfg.pruning) if cfg.pruning and self.is_rank0 else None

    # --- the four calls ---------------------------------------------------------------
    def report(self, step: int, **metrics: float) -> bool:
        """Rank 0's metrics at `step` (numbers or one-element tensors: reading one waits for the
        device). True on rank 0 when the pruner stopped the trial here (every rank learns it
        from `should_stop()`)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise TypeError(f"ctx.report(step, ...): step must be a whole number >= 0, got {step!r}")
        now = time.time()
        self.step, self.last_step_at = max(self.step, step), now
        self.reports += 1
        if self.reports == 1 and self.on_first_report is not None:
            self.on_first_report()
        if self.is_rank0:
            self._report(step, now, metrics)
        if self.cfg.hold_at_step is not None and step >= self.cfg.hold_at_step:
            self._hold()  # after the report: a test that kills here has a step reported and not yet saved
        return self.pruned

    def _report(self, step: int, now: float, metrics: dict[str, Any]) -> None:
        values = {}
        for key, value in metrics.items():
            number = float(value.detach().float().item() if isinstance(value, torch.Tensor) else value)
            values[key] = number
        if self._timing is not None and step > self._timing[0]:
            self.step_time_s = (now - self._timing[1]) / (step - self._timing[0])
            values.setdefault("step_time_s", self.step_time_s)
        self._timing = (step, now)
        self.latest.update(values)
        self.metrics.log(step, **values)
        evaluated = any(k.startswith("val_") for k in metrics)
        if not self.quiet and (evaluated or now - self._printed_at >= PROGRESS_EVERY_S):
            # The log follows training; validation figures only on the steps that reported them
            # (repeated on later lines they would read as fresh).
            shown = {**{k: v for k, v in self.latest.items() if not k.startswith("val_")}, **values}
            print(progress_line(self.trial_id, step, self.steps, shown), flush=True)
            self._printed_at = now
        if self.pruning is not None and not self.pruned and self.pruning.spec["metric"] in values:
            if self.pruning.should_stop(step, values):
                self.pruned = True
                self.metrics.tag("pruned_at_step", str(step))
        if evaluated or now - self._progress_at >= PROGRESS_EVERY_S:
            self.write_progress("running")
            self._progress_at = now

    def save(self, step: int, state: dict[str, Any]) -> Path | None:
        """Checkpoint `state` as step `step` (every rank calls it: the write is collective).
        Written in the background once staged; a later save or the trial's end waits for it.
        Once should_stop() said the pruner stopped the trial, nothing is written: a pruned
        trial is final (nothing resumes it), so its state at the stop would only delay the
        next trial on its device; the last save stands (returned)."""
        if not isinstance(state, dict) or not state:
            raise TypeError("ctx.save(step, state): state must be a non-empty dict (modules and optimizers may be values)")
        if self.stopped_by_pruner:  # agreed on every rank: all skip this collective write together
            return self.saved
        self.step = max(self.step, step)
        self.metrics.sync_journal()  # every step this checkpoint covers is on disk before it is
        # The last step's save is written here: the trial's end waits for it anyway, and a
        # background save costs a staged copy and a thread's round trip more (~2 ms, a short
        # trial's handover's worth).
        blocking = not self.checkpointer.background or step >= self.steps
        self.saved = self.checkpointer.save(step, checkpoint_state(step, state), blocking=blocking)
        return self.saved

    def load(self) -> tuple[int, dict[str, Any]] | None:
        """The newest verified checkpoint as (step, state), tensors on the CPU; None for a fresh
        start (every rank calls it)."""
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        found = self.checkpointer.latest()
        if found is None:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "loading in a single process": each rank reads the whole state, as intended
            state = _load_state_dict_from_keys(checkpoint_id=found)
        step = int(state["progress"]["step"])
        self.step = max(self.step, step)
        if self.started_step is None:
            self.started_step = step
        self.saved = Path(found)
        if self.is_rank0 and not self.quiet:
            print(f"trial {self.trial_id}: resumed at step {step} from {found}", flush=True)
            self.metrics.tag(f"resume.step-{step}", str(found))  # which checkpoint each resume used
        return step, state_of_checkpoint(state)

    def should_stop(self) -> bool:
        """True when the function should save and return: pruned, or its devices are wanted.
        Collective: every rank calls it at the same points."""
        self._calls += 1
        if self._agreed or (self.world_size > 1 and self._calls % max(1, self.cfg.control_every) != 0):
            return self._agreed  # asked every control_every calls: a broadcast per step would cost a round trip each
        wanted = self.is_rank0 and (self.terminated or (self._stop_requested is not None and self._stop_requested()))
        flags = torch.tensor([int(self.pruned), int(wanted)], dtype=torch.int32)
        if self._flags is not None:
            dist.broadcast(flags, src=0, group=self._flags)
        self.pruned, self.stopped = bool(flags[0]), bool(flags[1]) and not flags[0]
        self._agreed = self.pruned or self.stopped  # the same on every rank, and final
        return self._agreed

    @property
    def stopped_by_pruner(self) -> bool:
        """The pruner stopped the trial, as every rank knows it (should_stop said so): rank 0
        learns it at its report, the others only at the next agreement, so a collective step
        that depends on it asks this, not `pruned`."""
        return self._agreed and self.pruned

    # --- around the function --------------------------------------------------------------
    def write_progress(self, state: str) -> None:
        self.progress_state = state
        metrics = {k: v for k, v in self.latest.items() if k != "step_time_s"}
        if self.step_time_s is not None:
            metrics["step_time_s"] = self.step_time_s
        progress_now(state, self.step, self.steps, self.world_size, self.cfg.batch_size, metrics).write(self.cfg.trial_dir)

    def _hold(self) -> None:
        """Tests: wait here while `<trial_dir>/hold` exists (a step a test can kill at)."""
        hold = trial_files(self.cfg.trial_dir).hold
        if not hold.exists():
            return
        before = self.progress_state
        if self.is_rank0:
            self.write_progress("held")
        while hold.exists():
            time.sleep(HOLD_POLL_S)
        if self.is_rank0:  # as before the hold: a report that does not come from here is a stall
            self.write_progress(before)

    def close(self) -> None:
        """Wait for the save in flight, let the process groups go, send the last metrics."""
        try:
            self.checkpointer.wait()
        finally:
            for group in (self._flags, self._async):
                if group is not None:
                    dist.destroy_process_group(group)
            self._flags = self._async = None
            self.metrics.close()


class FunctionTrial:
    """Runs a function trial in one process: the counterpart of `training.trainer.Trainer`
    for `train_trial` and an elastic worker (attach, train with a stop check, detach)."""

    def __init__(self, cfg: TrialConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.fn = load_function(cfg.function)
        self.ctx: TrialContext | None = None
        self._step, self._last_step_at = 0, None
        self.start_lr = cfg.lr
        self.metrics = MetricsLogger(None, None)

    @property
    def phase(self) -> Phase:  # what a resize record says the new size trains with: the spec's batch
        return Phase(self.step, 0, self.cfg.batch_size)

    @property
    def step(self) -> int:
        return self.ctx.step if self.ctx is not None else self._step

    @property
    def last_step_at(self) -> float | None:
        return self.ctx.last_step_at if self.ctx is not None else self._last_step_at

    @property
    def progress_step(self) -> int:
        return self.step

    # A test's hold comes after a report (TrialContext._hold), never inside a generation's first
    # step: nothing to leave out of a resize's pause (training.elastic_worker record_resize).
    held_s = 0.0

    def attach(self, rank: int, world_size: int, local_rank: int, stop_requested: Callable[[], bool] | None = None) -> None:
        self.ctx = TrialContext(self.cfg, rank, world_size, local_rank, self.device, stop_requested)
        self.ctx.checkpointer.clean_stale()
        self.metrics = self.ctx.metrics

    def train(self, after_first_step: Callable[[], None] | None = None, starting: str = "running") -> dict[str, Any] | None:
        """Call the function: its result once it returned (and rank 0 wrote result.json), or
        None when it returned because the campaign asked for its devices. `starting`: the
        state progress.json says until its first report (see Trainer.train)."""
        ctx, cfg = self.ctx, self.cfg
        ctx.on_first_report = after_first_step
        started = time.time()
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every run
        if ctx.is_rank0:
            ctx.write_progress(starting)
        # A stopping campaign SIGTERMs its trials and waits a grace period before SIGKILL: in
        # it, should_stop() says yes and the function saves where it is (the main thread only
        # can take signals; an agent's generations are ended by their agent instead).
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, lambda *_: setattr(ctx, "terminated", True)) if in_main else None
        try:
            returned = self.fn(ctx, **((cfg.function or {}).get("kwargs") or {}))
            ctx.checkpointer.wait()  # the last save is durable before anything says so
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)
            self._step, self._last_step_at = ctx.step, ctx.last_step_at
        if ctx.stopped and not ctx.pruned:
            return None
        metrics = dict(ctx.latest)
        if isinstance(returned, dict):
            metrics.update({k: float(v) for k, v in returned.items() if isinstance(v, (int, float)) and math.isfinite(float(v))})
        result = {
            "trial_id": cfg.trial_id, "steps": ctx.step, "samples_seen": 0, "scaling": cfg.scaling, "world_size": ctx.world_size,
            "pruned": ctx.pruned, "resumed_from_step": ctx.started_step or 0, "wall_s": time.time() - started,
            "metrics": metrics, "checkpoint": str(ctx.saved or ""), "function": cfg.function["target"],
        }
        if ctx.is_rank0:
            ctx.latest = metrics
            ctx.write_progress("finished")
            write_result(cfg.result_path, result)  # signed: a reader trusts only this host's trainer's results
            if ctx.pruning is not None:
                ctx.pruning.finished(result)
        return result

    def save_checkpoint(self, blocking: bool = True) -> None:
        """What the agent's stop asks of a generation: the function saved before it returned."""
        if self.ctx is not None:
            self.ctx.checkpointer.wait()

    def write_progress(self, state: str) -> None:
        if self.ctx is not None:
            self.ctx.write_progress(state)

    def detach(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
        self.ctx = None
        self.metrics = MetricsLogger(None, None)

    def close(self) -> None:
        self.detach()


def check_function(function: dict[str, Any], check: dict[str, Any] | None, cfg: TrialConfig) -> None:
    """Before a campaign starts: the target imports and takes (ctx, **kwargs); where the spec
    names a `training.check` hook, it runs in this process on the CPU (its own two samples,
    one report and one save), the save is loaded back, and whatever fails is a FunctionError
    naming the field."""
    load_function(function)
    if check is None:
        return
    hook = load_function(check, "training.check")
    ctx = TrialContext(cfg, 0, 1, 0, torch.device("cpu"), async_saves=False, quiet=True)
    try:
        with warnings.catch_warnings():  # DCP's "single process" warning: a dry run is one
            warnings.simplefilter("ignore")
            hook(ctx, **(check.get("kwargs") or {}))
            loaded = ctx.saved is None or ctx.load() is not None
        if not ctx.reports:
            raise FunctionError(f"training.check: {check['target']} never called ctx.report(step, metric=value): the campaign "
                                "would see no progress and the search no objective")
        if not loaded:
            raise FunctionError(f"training.check: the checkpoint {check['target']} saved does not load back")
    except CampaignError:
        raise
    except Exception as e:
        raise FunctionError(f"training.check: {check['target']} raised {type(e).__name__}: {e}") from e
    finally:
        ctx.close()
