"""The DDP trainer: owns the loop; the Checkpointer owns saving, training.batches the data.

Invariant (DESIGN.md #1): the result does not depend on the number of processes, on
restarts or on resizes, for any model.
- Each step trains on the same global batch (training.data.SampleOrder), split into the
  trial's L logical ranks; a process runs the logical ranks it holds one after another
  (training.batches.local_spans), each split again into micro-batches of at most
  `max_device_batch` (gradient accumulation).
- Each logical rank's micro-batches run under that rank's own RNG stream, seeded from
  (seed, step, logical rank): `nn.Dropout` and anything else random draws what it would
  draw at L processes. BatchNorm sees each logical rank's batch; its running statistics
  are logical rank 0's, as DDP's buffer broadcast makes them at L processes.
- The mean loss of a micro-batch is scaled by its size x world_size / global_batch, so
  DDP's gradient average equals the gradient of the mean loss over the global batch.

In `scaling: goodput` (training.config) the batch instead follows the process count: each
call of `train` starts a `Phase` at the current step and sample position with the batch
of this world size (logical ranks = processes), the learning rate scaled to it, and the
trial ends after steps x batch_size samples. Metrics are logged against reference steps
(samples / batch_size), so curves compare across trials whatever their sizes were.

A Trainer outlives process groups: `attach` binds it to the current default group (a
torchrun job, or one generation of an elastic trial), `detach` lets it go, and
`state_bytes`/`load_state_bytes` move its state through memory to a process that joins.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
# A process's first optimizer imports torch._dynamo (torch.optim's `_disable_dynamo`): 0.35 s of
# CPU in every trainer. Imported with the trainer, a zygote (training/zygote.py) pays it once
# for every trainer it forks (tests/test_elastic, test_live_resize and test_workload: 7.5 % less CPU).
import torch._dynamo  # noqa: F401
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

from training.batches import EVAL_BATCH_MIN, Phase, Span, eval_batches, local_spans, make_feed
from training.checkpoint import Checkpointer
from training.checkpoint_remote import remote_for
from training.progress import progress_now
from training.fence import commit_guard, grant_of
from training.config import TrialConfig
from training.data import SampleOrder, shard_bounds
from training.exact import OrderedReduction
from training.flops import matmul_dtype, mfu, step_flops
from training.graphs import StepGraph, graph_plan
from training.batch_choice import read_batch_choice
from training.result import write_result
from training.layout import trial_files
from training.hashing import GAMMA, MIX1, MIX2, mix64
from training.metrics import MetricsLogger, progress_line
from training.noise_scale import LocalNorm, NoiseScale, decay_for, harmonic_mean, squared_norm
from training.pruning import Pruning
from training.workload import build_model, build_objective, build_optimizer, datasets

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
HOLD_POLL_S = 0.02


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> "DistEnv":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))


def lr_factor(schedule: str, warmup: int, total: int, step: int) -> float:
    """Multiplier of the base learning rate at `step` (linear warm-up, then the schedule);
    goodput trials pass samples for steps."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def step_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed for (seed, step, rank): SplitMix64's finalizer over a combination of
    the three (a microsecond, where SeedSequence takes several, on every step)."""
    return mix64(seed * GAMMA + step * MIX1 + rank * MIX2 + 1) >> 1


# The progress file is for people and the scheduler: once a second is fresh enough for both.
PROGRESS_EVERY_S = 1.0

# Called every `control_every` steps on every rank; True stops training at this boundary.
StopCheck = Callable[[int], bool]


@dataclass
class LogWindow:
    """A log window's figures; its mean loss still on the device, or on its way to the host."""

    step: int
    lr: float
    step_time_s: float
    mean_loss: torch.Tensor
    landed_event: "torch.cuda.Event | None" = None

    def copy_to_host(self) -> "LogWindow":
        """Start the loss's copy into pinned host memory; it lands when the device reaches it."""
        host = torch.empty((), dtype=self.mean_loss.dtype, pin_memory=True)
        host.copy_(self.mean_loss, non_blocking=True)
        self.mean_loss, self.landed_event = host, torch.cuda.Event()
        self.landed_event.record()
        return self

    def landed(self) -> bool:
        return self.landed_event is None or self.landed_event.query()

    def loss(self) -> float:
        if self.landed_event is not None:
            self.landed_event.synchronize()  # at an evaluation or the end: the device is waited on anyway
        return self.mean_loss.item()


class LossSums:
    """A log window's training loss, summed per logical rank on the device.

    Each process adds its micro-batches' losses (times their sizes) into its logical ranks'
    entries. At a log step the entries meet across processes: an all-reduce in which each entry
    has one nonzero term, so no rounding; then they are summed in logical order. The logged loss
    is the whole batch's mean, not rank 0's share, and in `reduction: exact` the same bits at any
    number of processes (each logical rank's losses are the same computation wherever it runs).
    """

    def __init__(self, logical_ranks: int, device: torch.device):
        self.sums = torch.zeros(logical_ranks, dtype=torch.float32, device=device)
        self.samples = 0  # the whole batch's samples the window has summed, over all processes

    def add(self, span: Span, loss: torch.Tensor) -> None:
        self.sums[span.logical_rank].add_(loss.detach().float(), alpha=span.size)

    def take_mean(self, world_size: int) -> torch.Tensor:
        """The window's mean loss (collective when `world_size` > 1); the window starts again."""
        if world_size > 1:
            dist.all_reduce(self.sums)
        mean = self.sums.sum() / self.samples
        self.sums.zero_()  # after the sum, in stream order: the mean is its own tensor
        self.samples = 0
        return mean

    def whole(self, world_size: int) -> dict[str, Any]:
        """The window so far, every logical rank's sum (collective when `world_size` > 1): what
        a checkpoint keeps and a resize carries, so that a window cut by a stop is logged as
        whole. Exact: each entry's other terms are zeros. Left on the device (a stop does not
        wait for it); `window_record` reads it where it is written out."""
        sums = self.sums.clone()
        if world_size > 1:
            dist.all_reduce(sums)
        return {"sums": sums, "samples": self.samples}

    def carry(self, window: dict[str, Any], held: set[int]) -> None:
        """Go on with `window` (from `whole`, or its record), holding the logical ranks in
        `held`. At another width (a goodput trial's resize) its total goes to logical rank 0."""
        sums = torch.as_tensor(window["sums"], dtype=torch.float32, device=self.sums.device)
        if len(sums) == len(self.sums):
            for rank in held:  # a copy on the device each (a list index would copy it from the host, and wait)
                self.sums[rank] = sums[rank]
        elif 0 in held:
            self.sums[0] = sums.sum()
        self.samples = int(window["samples"])


def window_record(window: dict[str, Any] | None) -> str:
    """A window from `LossSums.whole` as a checkpoint or a joiner keeps it (JSON: a float32
    reads back as the same bits)."""
    if window is None:
        return "null"
    sums = window["sums"]
    return json.dumps({"sums": sums.tolist() if isinstance(sums, torch.Tensor) else sums, "samples": window["samples"]})


class Trainer(Stateful):
    def __init__(self, cfg: TrialConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.train_set, self.val_set = datasets(cfg.data)
        self.order = SampleOrder(len(self.train_set), cfg.seed)
        self.feed = make_feed(self.train_set, self.order, cfg.batch_size, device,
                              cfg.data.get("on_device", "auto"), cfg.data.get("workers", 0))
        self._val_cache: dict = {}
        self._batches, self._batches_next = None, None  # the feed's open iterator, and the step it is at

        torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every run
        self.model = build_model(cfg.model).to(device)
        self.objective = build_objective(cfg.model, cfg.loss)  # the model's output (model.output) under the loss
        self.optimizer = build_optimizer(cfg.optimizer, self.model.parameters(), cfg.lr)
        self.step = 0
        self.start_lr = cfg.lr
        self.samples_seen = 0  # the data position: global samples trained on
        self.progress_state = "running"  # the state last written to progress.json (a test's hold puts it back)
        # This phase's batch and data-parallel width: the trial's own, unless goodput (attach).
        self.batch_size, self.width = cfg.batch_size, cfg.logical_ranks
        self.phase = Phase(0, 0, cfg.batch_size)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_multiplier)
        self.autocast_dtype = PRECISIONS[cfg.precision]
        # fp16 needs its loss scaled against underflow; bf16 has fp32's range and does not.
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
        self.buffers = list(self.model.buffers())  # BatchNorm's running statistics and the like
        self._allocated_after_setup = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self._pending_logs: list[LogWindow] = []  # log windows whose loss is on its way to the host
        self.last_step_at: float | None = None  # wall time the latest step completed
        self.held_s = 0.0  # time a test has held it at a step (hold_at_step), in all: not part of a resize's pause
        self.latest: dict[str, float] = {}
        self._record_kept = True  # a checkpoint holds the result's record (False: loading one written before it did)
        self._window_kept = True  # ... and the log window its step cuts
        self.window: dict[str, Any] | None = None  # that window, gathered, for the next `train` call to go on with
        self.env: DistEnv | None = None
        self.ddp: DDP | None = None
        self.forward: Callable | None = None  # the module a step calls: DDP's wrapper, compiled or not
        self.ordered: OrderedReduction | None = None  # reduction: exact
        self.ends_logical: tuple[bool, ...] = ()
        # The gradient noise scale (training.noise_scale), measured every noise_every steps
        # from two batch sizes of one step's gradient, where attach finds two (else no estimate).
        self.noise_every = cfg.log_every if cfg.noise_scale_every is None else cfg.noise_scale_every
        self.noise = NoiseScale(device, decay_for(max(1, self.noise_every)))
        self.noise_sizes: tuple[str, float, int, Any] | None = None  # (source, b_small, b_big, |g|² factor)
        self.local_norm: LocalNorm | None = None  # DDP's comm hook: each process's gradient before the average
        if cfg.reduction == "exact":
            # Bit for bit at any process count needs the same kernels every time.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
        elif torch.are_deterministic_algorithms_enabled():  # set by an earlier trial of a warm worker
            torch.use_deterministic_algorithms(False)
        self.spans: tuple[Span, ...] = ()
        self.checkpointer: Checkpointer | None = None
        self.metrics = MetricsLogger(None, None)
        self.pruning = Pruning(cfg.pruning) if cfg.pruning else None  # reports on rank 0 only
        self.pruned = False
        self._async_group = None
        self.trace = None  # an open file when cfg.trace: every (step, samples, loss) this process trains on
        self.step_graph: StepGraph | None = None  # the step replayed from a CUDA graph (training.graphs), where it can be
        self._said: set[str] = set()  # what the trial's log was told about CUDA graphs: each line once per process
        # Model FLOPs utilisation on a GPU (training.flops): the FLOPs of this process's step, counted at its
        # first step, over the device's measured peak at the trial's precision; logged as `mfu`.
        self.flops_per_step: float | None = None
        self.flops_per_sample: float | None = None  # the model's FLOPs per sample trained (a GPU's rank 0 measures them)
        self.peak_flops: float | None = None

    # --- binding to a process group -----------------------------------------------------
    def attach(self, env: DistEnv, trace_name: str | None = None) -> None:
        """Bind to the default process group just initialized (collective)."""
        self.env = env
        if self.cfg.trace:
            trace_dir = Path(self.cfg.trial_dir) / "trace"
            trace_dir.mkdir(parents=True, exist_ok=True)
            self.trace = open(trace_dir / f"{trace_name or f'rank{env.rank}'}.jsonl", "a", buffering=1)
        if self.cfg.goodput:  # the batch follows the size (or the scheduler's choice): one logical rank per process
            self.batch_size, self.width = self.cfg.chosen_batch(env.world_size, self._scheduled_batch(env)), env.world_size
        self.ddp = self.local_norm = None  # one process: nothing to all-reduce, no wrapper on the step's path
        if self.cfg.reduction == "exact":  # summed in logical order by OrderedReduction, not all-reduced
            self.ordered = OrderedReduction(self.model.parameters(), self.width, env.world_size, env.rank, self.device)
        elif env.world_size > 1:
            self.ddp = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
            if self.noise_every:
                self.local_norm = LocalNorm(env.world_size)
                self.ddp.register_comm_hook(self.local_norm, LocalNorm.hook)
        module = self.ddp or self.model
        self.forward = torch.compile(module) if self.cfg.compile else module
        self.spans = local_spans(self.batch_size, self.width, env.world_size, env.rank, self.cfg.max_device_batch)
        self.loss_sums = LossSums(self.width, self.device)
        # Where a logical rank's micro-batches end: exact reduction files its gradient there.
        self.ends_logical = tuple(i == len(self.spans) - 1 or self.spans[i + 1].logical_rank != s.logical_rank
                                  for i, s in enumerate(self.spans))
        self.noise_sizes = self._noise_sizes(env)
        if self.flops_per_sample is not None:  # measured at an earlier size: this process's samples per step changed
            self.flops_per_step = self.flops_per_sample * sum(s.size for s in self.spans)
        # Checkpoint writes run in a background thread: give their collectives a group of their own.
        self._async_group = dist.new_group(backend="gloo") if self.cfg.async_checkpoints and env.world_size > 1 else None
        self.checkpointer = Checkpointer(self.cfg.checkpoint_dir, self.cfg.keep_checkpoints, env.rank, env.world_size, self._async_group,
                                         guard=commit_guard(self.cfg.lease), grant=grant_of(self.cfg.lease),
                                         remote=remote_for(self.cfg.checkpoint_remote, self.cfg.keep_checkpoints),
                                         one_writer=self.cfg.one_checkpoint_writer, background=self.cfg.async_checkpoints)
        if env.rank == 0 and not self.metrics.enabled:
            self.metrics = MetricsLogger(self.cfg.mlflow_tracking_uri, self.cfg.mlflow_run_id,
                                         journal=trial_files(self.cfg.trial_dir).metrics_journal)
        elif env.rank != 0:
            self.metrics.close()
            self.metrics = MetricsLogger(None, None)
        self._plan_graph(env)

    def _scheduled_batch(self, env: DistEnv) -> int | None:
        """The batch the scheduler chose for this size (goodput with max_batch_size): rank 0
        reads the trial's batch.json and every rank takes its answer, so all train one batch
        even if the file changes meanwhile (collective)."""
        if not (self.cfg.goodput and self.cfg.max_batch_size):
            return None
        chosen = 0
        if env.rank == 0:
            choice = read_batch_choice(self.cfg.trial_dir)  # none, or not one (warned): the batch follows the size
            if choice is not None and choice.devices == env.world_size:
                chosen = choice.batch_size
        if env.world_size > 1:
            value = torch.tensor([chosen], dtype=torch.int64, device=self.device if self.device.type == "cuda" else "cpu")
            dist.broadcast(value, 0)
            chosen = int(value.item())
        return chosen or None

    def _noise_sizes(self, env: DistEnv) -> tuple[str, float, int, Any] | None:
        """Where a step gives a small-batch gradient beside the step's (b_big = the batch),
        and what turns its |.|² into the squared norm of a mean gradient: the logical ranks'
        slots (exact reduction: slot = its samples / B x its mean gradient), each process's
        gradient before DDP's average (world_size x its samples / B x its mean), or the first
        micro-batch's (its samples / B x its mean). None: one batch size only, no estimate."""
        big = self.batch_size
        if not self.noise_every:
            return None
        if self.ordered is not None and self.width > 1:
            sizes = [hi - lo for lo, hi in (shard_bounds(big, self.width, r) for r in range(self.width))]
            factors = torch.tensor([(big / n) ** 2 for n in sizes], device=self.device)
            return "slots", harmonic_mean(sizes), big, factors
        if self.ddp is not None:
            local = [sum(s.size for s in local_spans(big, self.width, env.world_size, r, None)) for r in range(env.world_size)]
            return "ddp", harmonic_mean(local), big, (big / (env.world_size * local[env.rank])) ** 2
        if len(self.spans) > 1 and (self.ordered is None or not self.ends_logical[0]):
            return "micro", self.spans[0].size, big, (big / self.spans[0].size) ** 2
        return None

    def _measure_noise(self, small: torch.Tensor | None) -> None:
        """One measurement from this step's gradients, before unscaling and clipping: device
        ops only (and, across processes, one all-reduce of a scalar); read at log steps."""
        source, b_small, b_big, factor = self.noise_sizes
        if source == "ddp":  # the mean over processes (all-reduced below)
            small = self.local_norm.take() * (factor / self.env.world_size)
        elif source == "slots":
            small = (small * factor).mean()
        else:
            small = small * factor
        big = squared_norm(p.grad for p in self.model.parameters())
        if self.scaler.is_enabled():  # fp16: the gradients carry the loss scale (an overflow: skipped)
            unscale = self.scaler._scale.reciprocal().square()
            small, big = small * unscale, big * unscale
        # Summed while the next steps run: the estimator waits for it at its next update or read.
        pending = dist.all_reduce(small, async_op=True) if source == "ddp" else None
        self.noise.update(small, b_small, big, b_big, check_finite=self.scaler.is_enabled(), after=pending)

    def detach(self) -> None:
        """Finish what is in flight and let go of the process group (collective)."""
        self.noise.settle()
        if self.checkpointer is not None:
            self.checkpointer.wait()
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
        if self.trace is not None:
            self.trace.close()
        self.feed.close()
        self._batches = self._batches_next = None
        if self.step_graph is not None:  # the next attach captures again, at its own size and batch
            self.step_graph.release()
            self.step_graph = None
        self.ordered = self.local_norm = None
        self.ddp, self.forward, self.checkpointer, self._async_group, self.trace = None, None, None, None, None

    @property
    def is_rank0(self) -> bool:
        return self.env is not None and self.env.rank == 0

    # --- Stateful: what a checkpoint holds -------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            # The data position and the RNG streams are functions of (seed, step): see the
            # module docstring. They are stored so a resume can check it continues the same run.
            "scaler": self.scaler.state_dict(),
            "progress": {"step": self.step, "samples_seen": self.samples_seen, "seed": self.cfg.seed,
                         "logical_ranks": self.cfg.logical_ranks, "scaling": self.cfg.scaling},
            # What the result is made of beyond the weights: the noise scale's running averages and
            # the latest metrics (an evaluation's, the last window's loss), so that a resumed
            # trial's result is an uninterrupted one's. Left out when loading a checkpoint
            # written before they were kept (`checkpoint_has`).
            **({"record": {"noise": self.noise.state_dict(), "latest": json.dumps(self.latest),
                           # the log window the checkpoint's step cuts (save_checkpoint gathers it)
                           **({"window": window_record(self.window)} if self._window_kept else {})}}
               if self._record_kept else {}),
        }

    def checkpoint_has(self, keys: set[str]) -> None:
        """Told by the checkpointer, before a load, which keys the checkpoint holds."""
        self._record_kept = any(k.startswith("trainer.record.") for k in keys)
        self._window_kept = "trainer.record.window" in keys

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._release_graph()
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler.is_enabled() and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        progress = state["progress"]
        if progress["seed"] != self.cfg.seed:
            raise RuntimeError(f"checkpoint was written with seed {progress['seed']}, this trial has {self.cfg.seed}")
        if progress.get("scaling", "reproducible") != self.cfg.scaling:
            raise RuntimeError(f"checkpoint was written with scaling {progress.get('scaling', 'reproducible')}, this trial has "
                               f"{self.cfg.scaling}: start the trial afresh")
        if progress.get("logical_ranks", self.cfg.logical_ranks) != self.cfg.logical_ranks:
            raise RuntimeError(f"checkpoint was written with {progress['logical_ranks']} logical ranks, this trial has "
                               f"{self.cfg.logical_ranks}: its results would differ; start the trial afresh")
        self.step = int(progress["step"])
        self.samples_seen = int(progress.get("samples_seen", self.step * self.cfg.batch_size))
        self.window = None  # the window of a stop before this load is not this position's
        if "record" in state:
            self.noise.load_state_dict(state["record"]["noise"])
            self.latest = {k: float(v) for k, v in json.loads(state["record"]["latest"]).items()}
            self.window = json.loads(state["record"].get("window", "null"))
        self._record_kept = self._window_kept = True  # every checkpoint written from now on keeps them

    def state_bytes(self) -> bytes:
        """The whole training state, for a process joining through memory (not disk)."""
        buf = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(), "step": self.step,
                    "samples_seen": self.samples_seen, "noise": self.noise.state_dict(), "window": window_record(self.window)}, buf)
        return buf.getvalue()

    def load_state_bytes(self, payload: bytes) -> None:
        state = torch.load(io.BytesIO(payload), map_location=self.device, weights_only=True)
        self._release_graph()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        if "noise" in state:
            self.noise.load_state_dict(state["noise"])
        self.window = json.loads(state.get("window", "null"))

    # --- the data position and the learning rate ------------------------------------------
    @property
    def done(self) -> bool:
        if self.cfg.goodput:
            return self.samples_seen >= self.cfg.total_samples
        return self.step >= self.cfg.steps

    @property
    def total_steps(self) -> int:
        """The step the trial ends at: its steps, or (goodput) as many as the samples left
        take at this phase's batch."""
        if not self.cfg.goodput:
            return self.cfg.steps
        return self.step + max(0, -(-(self.cfg.total_samples - self.samples_seen) // self.batch_size))

    @property
    def progress_step(self) -> int:
        """The step metrics are logged at: the step, or (goodput) samples / batch_size, the
        step a trial that was never resized would be at."""
        return self.samples_seen // self.cfg.batch_size if self.cfg.goodput else self.step

    def _lr_multiplier(self, step: int) -> float:
        """LambdaLR's factor after `step` steps; goodput: at the data position, times this
        batch's scale (LambdaLR calls it after train_step has counted the step's samples)."""
        cfg = self.cfg
        if not cfg.goodput:
            return lr_factor(cfg.schedule, cfg.warmup_steps, cfg.steps, step)
        factor = lr_factor(cfg.schedule, cfg.warmup_steps * cfg.batch_size, cfg.total_samples, self.samples_seen)
        return cfg.lr_scale(self.batch_size) * factor

    def _start_phase(self) -> None:
        """From this step on, batches of this world size's batch; goodput: its learning rate now."""
        self.phase = Phase(self.step, self.samples_seen, self.batch_size)
        self.feed.phase = self.phase
        if self.cfg.goodput:
            multiplier = self._lr_multiplier(self.step)
            for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
                group["lr"] = base * multiplier

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # --- the loop ----------------------------------------------------------------------
    def resume(self) -> int | None:
        """Load the newest valid checkpoint, if any (collective); its step."""
        self.checkpointer.clean_stale()
        step = self.checkpointer.load_latest({"trainer": self})
        if step is not None and self.is_rank0:  # which checkpoint each resume used, on the trial's MLflow run
            self.metrics.tag(f"resume.step-{step}", str(self.checkpointer.loaded))
        return step

    def save_checkpoint(self, blocking: bool = True) -> None:
        self.sync_buffers()
        if self.is_rank0:
            # A log window whose loss is still on its way from the device (a GPU's) is logged
            # now: a kill after this checkpoint resumes past its step, which would never be
            # logged again (a hole in the curves).
            self._flush_logs(wait=True)
        self.sync_latest()  # after the flush: the latest metrics the checkpoint keeps include that window's
        self.window = self.loss_sums.whole(self.env.world_size)  # every process's part of it (collective)
        self.metrics.sync_journal()  # every step this checkpoint covers is on disk before it is
        self.checkpointer.save(self.step, {"trainer": self}, blocking=blocking)

    def sync_buffers(self) -> None:
        """Every process takes rank 0's buffers (BatchNorm statistics), so a checkpoint,
        whichever rank's copy DCP keeps, holds logical rank 0's (collective)."""
        if self.buffers and self.env is not None and self.env.world_size > 1:
            for b in self.buffers:
                dist.broadcast(b, src=0)

    def sync_latest(self) -> None:
        """Every process takes rank 0's latest metrics (only rank 0 fills them): a checkpoint
        keeps one copy of them, from whichever rank DCP's de-duplication picks (collective)."""
        if self.env is not None and self.env.world_size > 1:
            box = [self.latest if self.is_rank0 else None]
            dist.broadcast_object_list(box, src=0)
            self.latest = box[0]

    def _seed(self, step: int, logical_rank: int) -> None:
        # Only the generators a step can use: torch.manual_seed would also seed every
        # accelerator backend, a measurable cost on short steps.
        seed = step_seed(self.cfg.seed, step, logical_rank)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)

    def _autocast(self, cache: bool = True):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=cache)

    def train_step(self, step: int, batches) -> None:
        """One optimizer step over this process's micro-batches (pulled from `batches`); their
        losses are added to the log window's sums (`self.loss_sums`), left on the device (reading
        them would make the host wait for the device on every step)."""
        if self.step_graph is not None:
            self._graph_step(step, batches)
            return
        cfg, spans = self.cfg, self.spans
        # One multiplication; DDP then averages over world_size, so each sample's gradient
        # ends up scaled by 1 / batch_size at every world size (exact: summed, not averaged).
        scale = (1 if self.ordered is not None else self.env.world_size) / self.batch_size
        # Running statistics are logical rank 0's (what DDP's buffer broadcast keeps at L
        # processes): rank 0 runs every other logical rank from the step's starting buffers.
        keep_buffers = self.buffers and self.env.rank == 0 and spans[-1].logical_rank > 0
        start_buffers = kept = None
        small_sq = None
        measure = self.noise_sizes is not None and (step + 1) % self.noise_every == 0  # the step before a log step
        if measure and self.local_norm is not None:
            self.local_norm.armed = True
        last = len(spans) - 1
        for i, span in enumerate(spans):
            x, y = next(batches)
            if self.flops_per_step is None and i == 0:
                self._count_flops(x, y)
            if span.first:
                self._seed(step, span.logical_rank)
                if keep_buffers:
                    if span.logical_rank == 0:
                        start_buffers = [b.clone() for b in self.buffers]
                    else:
                        if kept is None:
                            kept = [b.clone() for b in self.buffers]
                        for b, v in zip(self.buffers, start_buffers):
                            b.copy_(v)
            # Gradients are reduced across processes once per step, on the last micro-batch.
            with (self.ddp.no_sync() if self.ddp is not None and i < last else contextlib.nullcontext()):
                with self._autocast():
                    loss = self.objective(self.forward, x, y)  # the mean over the micro-batch
                factor = span.size * scale  # 1 when the batch splits evenly: no op on the device then (exact either way)
                self.scaler.scale(loss if factor == 1.0 else loss * factor).backward()
            if measure and i == 0 and self.noise_sizes[0] == "micro":
                small_sq = squared_norm(p.grad for p in self.model.parameters())
            self.loss_sums.add(span, loss)
            if self.ordered is not None and self.ends_logical[i]:
                self.ordered.take(span.logical_rank)
            if self.trace is not None:
                samples = self.order.batch_at(self.phase.position(step), self.batch_size)[span.start:span.stop]
                self.trace.write(json.dumps({"step": step, "offset": span.start, "samples": samples.tolist(),
                                             "loss_sum": loss.item() * span.size}) + "\n")
        if kept is not None:
            for b, v in zip(self.buffers, kept):
                b.copy_(v)
        if self.ordered is not None:
            slot_sq = self.ordered.reduce(slot_norms=measure and self.noise_sizes[0] == "slots")
            small_sq = small_sq if slot_sq is None else slot_sq
        if measure:
            self._measure_noise(small_sq)
        self._optimizer_step()

    def _optimizer_step(self) -> None:
        """After the step's gradients: clipping, the optimizer and the schedule (outside any graph)."""
        if self.cfg.grad_clip_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.samples_seen += self.batch_size  # before the scheduler: a goodput schedule counts samples
        self.scheduler.step()
        if self.step_graph is None or not self.step_graph.captured:
            self.optimizer.zero_grad(set_to_none=True)
        # else the gradients are the graph's outputs: each replay writes them afresh, and
        # set to None the optimizer would no longer see what the graph writes.

    # --- CUDA graphs (training.graphs) ---------------------------------------------------------
    def _plan_graph(self, env: DistEnv) -> None:
        """At each attach: capture this size's step, or say once why not."""
        plan = graph_plan(self.cfg.cuda_graphs, self.device.type, env.world_size, len(self.spans), self.cfg.trace)
        assert not plan.capture or self.noise_sizes is None  # one micro-batch in one process: one batch size, no estimate
        self.step_graph = StepGraph(self.device, self._graphed_micro_batch, self._drop_grads) if plan.capture else None
        self._say_graphs(("on: " if plan.capture else "off: ") + plan.reason, warn=self.cfg.cuda_graphs == "on" and not plan.capture)

    def _say_graphs(self, line: str, warn: bool = False) -> None:
        if line in self._said or self.env is None or self.env.rank != 0:
            return
        self._said.add(line)
        print(f"{'warning: training.cuda_graphs is on, but ' if warn else ''}cuda_graphs {line}", flush=True)
        self.metrics.tag("cuda_graphs", line[:500])

    def _graph_step(self, step: int, batches) -> None:
        """One step of one micro-batch: its forward and backward from the graph (captured at the
        third step; eager before it, and for good after a failed capture), then the optimizer."""
        span = self.spans[0]
        x, y = next(batches)
        if self.flops_per_step is None:
            self._count_flops(x, y)
        self._seed(step, span.logical_rank)  # read by the replay: the eager step's random draws
        self.loss_sums.add(span, self.step_graph.step(x, y))
        if self.step_graph.failed is not None:
            self._say_graphs(f"off: {self.step_graph.failed}", warn=self.cfg.cuda_graphs == "on")
        self._optimizer_step()

    def _graphed_micro_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """What the graph holds: the forward with the loss, the backward, and (exact) the
        gradient filed in its slot and summed; its mean loss, on the device."""
        span = self.spans[0]
        # A graph replays the casts it captured: autocast's cache of cast weights would hand
        # the replay a copy cast before the optimizer changed them.
        with self._autocast(cache=False):
            loss = self.objective(self.forward, x, y)
        factor = span.size * (1 if self.ordered is not None else self.env.world_size) / self.batch_size
        self.scaler.scale(loss if factor == 1.0 else loss * factor).backward()
        if self.ordered is not None:
            self.ordered.take(span.logical_rank)
            self.ordered.reduce()
        return loss.detach()

    def _drop_grads(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def _release_graph(self) -> None:
        """Weights or optimizer state loaded: the graph captures again at the next step."""
        if self.step_graph is not None:
            self.step_graph.release()

    def _count_flops(self, x: Any, y: Any) -> None:
        """This process's model FLOPs per step and the device's peak, on a GPU's rank 0 (which
        logs `mfu`); on a CPU slot no figure: its peak would be measured on the core the trial
        trains on, at each start, for a figure `campaign profile` already gives."""
        self.flops_per_step = 0.0
        if self.device.type != "cuda" or not self.is_rank0:
            return
        from training.roofline import matmul_peak

        try:
            local = sum(s.size for s in self.spans)
            per_micro_batch = step_flops(lambda: build_model(self.cfg.model), self.objective, x, y, model=self.model)
            self.flops_per_sample = per_micro_batch / self.spans[0].size
            self.flops_per_step = self.flops_per_sample * local
            self.peak_flops = matmul_peak(self.device, matmul_dtype(self.cfg.precision))
            torch.cuda.reset_peak_memory_stats(self.device)  # the probe's matrices are not the trial's peak
        except Exception as exc:  # a model the meta device cannot run (data-dependent shapes): no MFU
            self.flops_per_step = 0.0
            print(f"mfu: not measured ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", flush=True)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss (and accuracy, for class targets) over the validation set, on this process.
        Rank 0 (the one that evaluates) writes its progress at most every PROGRESS_EVERY_S
        while the batches go by: the campaign's watchdog reads a long evaluation as alive,
        even the first one, which nothing before says to expect (tasks/watchdog.py)."""
        self.model.eval()
        loss_sum = correct = count = 0.0
        progress_at = time.time()
        try:
            for x, y in eval_batches(self.val_set, max(self.cfg.batch_size, EVAL_BATCH_MIN), self.device,
                                     self.cfg.data.get("on_device", "auto"), self.cfg.data.get("workers", 0), self._val_cache):
                with self._autocast():
                    raw = self.objective.forward(self.model, x, y)
                    loss = self.objective.loss(raw, y)
                out = self.objective.predictions(raw)
                n = len(y)
                loss_sum += loss.float() * n
                if correct is not None and isinstance(out, torch.Tensor) and not y.is_floating_point() and out.shape[:-1] == y.shape:
                    correct += (out.argmax(-1) == y).float().mean() * n
                else:
                    correct = None
                count += n
                if self.is_rank0 and time.time() - progress_at >= PROGRESS_EVERY_S:
                    self.write_progress("running")
                    progress_at = time.time()
        finally:
            self.model.train()
        metrics = {"val_loss": float(loss_sum / count)}
        if correct is not None:
            metrics["val_accuracy"] = float(correct / count)
        return metrics

    def write_progress(self, state: str) -> None:
        # A status for people and the scheduler, written often: no fsync on the training path.
        self.progress_state = state
        progress_now(state, self.progress_step, self.cfg.steps, self.env.world_size, self.batch_size, self.latest,
                     samples_seen=self.samples_seen).write(self.cfg.trial_dir)

    def train(self, should_stop: StopCheck | None = None, after_first_step: Callable[[], None] | None = None,
              starting: str = "running") -> dict[str, Any] | None:
        """Train to the end (returns the result) or until `should_stop` says so (returns None).

        `should_stop` is called on every rank at the same steps (it may be collective);
        `after_first_step` once, when the first step of this call has completed. `starting`:
        the state progress.json says until then ("resizing" for a generation after a resize:
        the campaign's watchdog gives its start a resize's time, tasks/watchdog.py).
        """
        cfg = self.cfg
        started, start_step = time.time(), self.step
        self.loss_sums = LossSums(self.width, self.device)
        if self.window is not None:  # the window a stop or a checkpoint cut goes on
            self.loss_sums.carry(self.window, {span.logical_rank for span in self.spans})
            self.window = None
        window_steps, window_start = 0, time.perf_counter()
        progress_at = 0.0
        self._start_phase()  # at the position this call starts from: loaded, or where the last call stopped
        self.start_lr = self.lr  # what this call's first step trains with: a resize's record says it
        batches = self._batches_at(self.step)
        if self.is_rank0:
            if cfg.goodput:  # the batch and learning rate this size trains with, on the trial's record
                self.metrics.log(self.progress_step, batch_size=self.batch_size)
            self.write_progress(starting)
        while not self.done:
            if should_stop is not None and self.step % cfg.control_every == 0 and self.step > start_step and should_stop(self.step):
                self._batches_next = self.step  # a later call at this step goes on with the same feed
                self.window = self.loss_sums.whole(self.env.world_size)  # the next call's first log step logs it whole
                self._flush_logs(wait=True)
                return None
            if cfg.hold_at_step is not None and (self.step == cfg.hold_at_step or (
                    self.step > cfg.hold_at_step and self.step % cfg.control_every == 0)):
                self.hold(getattr(should_stop, "requested", None))
            self.train_step(self.step, batches)
            self.step += 1
            self.last_step_at = time.time()
            if self.step == start_step + 1:
                if self.is_rank0:  # the launch's first step is seen (`campaign launch --timings`)
                    self.write_progress("running")
                if after_first_step is not None:
                    after_first_step()
            evaluate = self.step % cfg.eval_every == 0 or self.done
            stop_here = False
            window_steps += 1
            self.loss_sums.samples += self.batch_size
            if evaluate or self.step % cfg.log_every == 0:
                # The window's loss is the whole batch's, not rank 0's share: every process's
                # sums meet here (collective, at the same steps everywhere; no host wait on a GPU).
                window_loss = self.loss_sums.take_mean(self.env.world_size)
                step_time_s, window_steps = (time.perf_counter() - window_start) / window_steps, 0
                if self.is_rank0:
                    # Logged every log_every steps, as means over the window (a metric costs CPU
                    # on the training core). On a GPU the window's loss comes back by an
                    # asynchronous copy, logged at a later log step once it has landed: reading
                    # it now would wait for the device. An evaluation waits anyway: all land.
                    window = LogWindow(self.progress_step, self.lr, step_time_s, window_loss)
                    if evaluate or self.device.type != "cuda":
                        self._pending_logs.append(window)
                        self._flush_logs(wait=True, hold_last_line=evaluate)
                    else:
                        self._pending_logs.append(window.copy_to_host())
                        self._flush_logs(wait=False)
                    if evaluate:
                        self.latest.update(self.evaluate())
                        stop_here = self.pruning is not None and not self.done and self.pruning.should_stop(self.progress_step, self.latest)
                        # Evaluation metrics go to MLflow at the steps they were measured, not again at
                        # each log step (a curve of repeats); the latest stay in progress.json and the log.
                        self.metrics.log(self.progress_step, **{k: v for k, v in self.latest.items() if k.startswith("val_")})
                        print(progress_line(cfg.trial_id, self.progress_step, cfg.steps, self.latest), flush=True)
                window_start = time.perf_counter()  # an evaluation is not a training step
            if self.pruning is not None and evaluate and not self.done and self.agree(stop_here):
                self.pruned = True  # early stopping: end here, with a result that says so
                self.metrics.tag("pruned_at_step", str(self.progress_step))
                break
            if self.step % cfg.checkpoint_every == 0 and not self.done:
                self.save_checkpoint(blocking=False)
            # At any step, not only log steps: the campaign's watchdog (tasks/watchdog.py) takes a
            # step that stands still for a stall, however far apart the log steps are.
            if self.is_rank0 and self.last_step_at - progress_at >= PROGRESS_EVERY_S:
                self.write_progress("running")
                progress_at = self.last_step_at
        if self.pruned:
            # A pruned trial is final (nothing resumes it): its state at the stop is not written,
            # which would only delay the next trial on its devices; the last save stands.
            self.checkpointer.wait()
        else:
            self.save_checkpoint(blocking=True)  # the final state is durable before the result says so
        if self.is_rank0 and "val_accuracy" not in self.latest:
            self.latest.update(self.evaluate())  # resumed from the final checkpoint: no step ran
        result = {
            "trial_id": cfg.trial_id, "steps": self.step, "samples_seen": self.samples_seen, "scaling": cfg.scaling,
            "world_size": self.env.world_size, "pruned": self.pruned,
            "resumed_from_step": start_step, "wall_s": time.time() - started,
            "metrics": dict(self.latest),
            "checkpoint": str(self.checkpointer.newest() or ""),
            # What the trial's packing estimate is held against (bench/gpu_suite.py): this
            # process's peak of allocated device memory, None on a CPU slot.
            "peak_device_memory_bytes": torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None,
            "device_memory": self._device_memory(),
        }
        if self.is_rank0:
            self.write_progress("finished")
            write_result(cfg.result_path, result)  # signed: a reader trusts only this host's trainer's results
            if self.pruning is not None:
                self.pruning.finished(result)
        return result

    def _flush_logs(self, wait: bool, hold_last_line: bool = False) -> None:
        """Log the windows whose loss has reached the host, in order (all of them if `wait`);
        `hold_last_line`: the last one's progress line is printed by the caller (with the
        evaluation's metrics)."""
        while self._pending_logs and (wait or self._pending_logs[0].landed()):
            window = self._pending_logs.pop(0)
            self.latest.update(train_loss=window.loss(), lr=window.lr, step_time_s=window.step_time_s)
            if self.flops_per_step and self.peak_flops and window.step_time_s > 0:
                self.latest["mfu"] = mfu(self.flops_per_step, window.step_time_s, self.peak_flops)
            noise = self.noise.value()  # in samples; none until a measurement says so
            if noise is not None:  # (carried through a resize to a size that cannot measure it)
                self.latest["grad_noise_scale"] = noise
            else:
                self.latest.pop("grad_noise_scale", None)
            self.metrics.log(window.step, **{k: v for k, v in self.latest.items() if not k.startswith("val_")})
            if not (hold_last_line and not self._pending_logs):
                # The log follows training. Validation figures only on the lines of the steps that
                # measured them (the caller's): repeated here they would read as fresh.
                fresh = {k: v for k, v in self.latest.items() if not k.startswith("val_")}
                print(progress_line(self.cfg.trial_id, window.step, self.cfg.steps, fresh), flush=True)

    def _device_memory(self) -> dict[str, int] | None:
        """Where the peak came from: the allocator's pools (large: blocks over 1 MB, such as
        cuBLAS's workspaces) and what was allocated once the model and data were placed."""
        if self.device.type != "cuda":
            return None
        stats = torch.cuda.memory_stats(self.device)
        return {"after_setup": self._allocated_after_setup,
                "large_pool_peak": stats.get("allocated_bytes.large_pool.peak", 0),
                "small_pool_peak": stats.get("allocated_bytes.small_pool.peak", 0),
                "reserved_peak": stats.get("reserved_bytes.all.peak", 0)}

    def agree(self, decision: bool) -> bool:
        """Rank 0's decision, on every rank (collective; called at the same steps everywhere)."""
        if self.env.world_size == 1:
            return decision
        flag = torch.tensor([int(decision)], device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _batches_at(self, step: int):
        """The feed's micro-batches from `step` on: the open iterator when it is there (a
        DataLoader's workers and prefetched batches survive a pause), else a new one."""
        if self._batches is None or self._batches_next != step:
            self.feed.close()
            self._batches = iter(self.feed.batches(step, self.total_steps, self.spans))
        self._batches_next = None
        return self._batches

    def hold(self, stop_requested: Callable[[], bool] | None = None) -> None:
        """Tests: wait here while `<trial_dir>/hold` exists (a step a test can count on: the
        hold step, then every control step after it while the file is there), unless the
        agent asks the trial to stop (`stop_requested`): a held trial still resizes, then
        waits again in its next generation, so a short trial can take several resizes."""
        hold = trial_files(self.cfg.trial_dir).hold
        if not hold.exists() or (stop_requested is not None and stop_requested()):
            return
        before = self.progress_state
        if self.is_rank0:
            self.write_progress("held")
        since = time.time()
        while hold.exists() and not (stop_requested is not None and stop_requested()):
            time.sleep(HOLD_POLL_S)
        self.held_s += time.time() - since
        if self.is_rank0:  # as before the hold: a step that stands still from here is a stall
            self.write_progress(before)

    def close(self) -> None:
        self.feed.close()
        self.metrics.close()

