"""The DDP trainer: owns the loop; the Checkpointer owns saving.

Invariant (DESIGN.md #1): the result does not depend on the world size, on restarts or on
resizes.
- Each step trains on the same global batch (training.data.SampleOrder), split by rank,
  and split again into micro-batches of at most `max_device_batch` (gradient accumulation).
- The loss is summed and scaled by world_size / global_batch, so DDP's gradient average
  equals the gradient of the mean loss over the global batch, for any split.
- Dropout masks come from (seed, step, global sample position) (training.dropout), and the
  global RNG is reseeded every step from (seed, step, rank) for anything else.

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

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

from training.checkpoint import Checkpointer
from training.config import TrialConfig
from training.data import SampleOrder, load_digits_npz, shard_bounds
from training.dropout import batch_context
from training.files import write_json_atomic
from training.hashing import GAMMA, MIX1, MIX2, mix64
from training.metrics import MetricsLogger
from training.models import build_model


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> "DistEnv":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))


def lr_factor(schedule: str, warmup: int, total: int, step: int) -> float:
    """Multiplier of the base learning rate at `step` (linear warm-up, then the schedule)."""
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


class Trainer(Stateful):
    def __init__(self, cfg: TrialConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        data = load_digits_npz(cfg.data_path)
        self.train_x, self.train_y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
        self.val_x, self.val_y = torch.from_numpy(data.val_x).to(device), torch.from_numpy(data.val_y).to(device)
        self.order = SampleOrder(len(self.train_y), cfg.seed)

        torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every run
        self.model = build_model(cfg.model, **cfg.model_kwargs).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg.schedule, cfg.warmup_steps, cfg.steps, s)
        )
        self.step = 0
        self.last_step_at: float | None = None  # wall time the latest step completed
        self.latest: dict[str, float] = {}
        self.env: DistEnv | None = None
        self.ddp: DDP | None = None
        self.checkpointer: Checkpointer | None = None
        self.metrics = MetricsLogger(None, None)
        self._async_group = None
        self.trace = None  # an open file when cfg.trace: every (step, samples, loss) this process trains on

    # --- binding to a process group -----------------------------------------------------
    def attach(self, env: DistEnv, trace_name: str | None = None) -> None:
        """Bind to the default process group just initialized (collective)."""
        self.env = env
        if self.cfg.trace:
            trace_dir = Path(self.cfg.trial_dir) / "trace"
            trace_dir.mkdir(parents=True, exist_ok=True)
            self.trace = open(trace_dir / f"{trace_name or f'rank{env.rank}'}.jsonl", "a", buffering=1)
        self.ddp = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        # Checkpoint writes run in a background thread: give their collectives a group of their own.
        self._async_group = dist.new_group(backend="gloo") if self.cfg.async_checkpoints else None
        self.checkpointer = Checkpointer(self.cfg.checkpoint_dir, self.cfg.keep_checkpoints, env.rank, env.world_size, self._async_group)
        if env.rank == 0 and not self.metrics.enabled:
            self.metrics = MetricsLogger(self.cfg.mlflow_tracking_uri, self.cfg.mlflow_run_id)
        elif env.rank != 0:
            self.metrics.close()
            self.metrics = MetricsLogger(None, None)

    def detach(self) -> None:
        """Finish what is in flight and let go of the process group (collective)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
        if self.trace is not None:
            self.trace.close()
        self.ddp, self.checkpointer, self._async_group, self.trace = None, None, None, None

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
            "progress": {"step": self.step, "samples_seen": self.step * self.cfg.batch_size, "seed": self.cfg.seed},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["progress"]["seed"] != self.cfg.seed:
            raise RuntimeError(f"checkpoint was written with seed {state['progress']['seed']}, this trial has {self.cfg.seed}")
        self.step = int(state["progress"]["step"])

    def state_bytes(self) -> bytes:
        """The whole training state, for a process joining through memory (not disk)."""
        buf = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "step": self.step}, buf)
        return buf.getvalue()

    def load_state_bytes(self, payload: bytes) -> None:
        state = torch.load(io.BytesIO(payload), map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])

    # --- the loop ----------------------------------------------------------------------
    def resume(self) -> int | None:
        """Load the newest valid checkpoint, if any (collective); its step."""
        self.checkpointer.clean_stale()
        return self.checkpointer.load_latest({"trainer": self})

    def save_checkpoint(self, blocking: bool = True) -> None:
        self.checkpointer.save(self.step, {"trainer": self}, blocking=blocking)

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step; this rank's summed loss, left on the device (reading it would
        make the host wait for the device on every step)."""
        cfg, env = self.cfg, self.env
        batch = self.order.global_batch(step, cfg.batch_size)
        offset, stop = shard_bounds(cfg.batch_size, env.world_size, env.rank)
        local = batch[offset:stop]
        chunks = math.ceil(len(local) / cfg.max_device_batch) if cfg.max_device_batch else 1
        # Only the generators this step can use: torch.manual_seed would also seed every
        # accelerator backend, a measurable cost on steps of a few milliseconds.
        seed = step_seed(cfg.seed, step, env.rank)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        # One multiplication; DDP then averages over world_size, so each sample's gradient
        # ends up scaled by 1 / batch_size at every world size.
        scale = env.world_size / cfg.batch_size
        total = None
        start = 0
        for i, micro in enumerate(np.array_split(local, chunks) if chunks > 1 else (local,)):
            index = torch.from_numpy(micro)
            x = self.train_x[index].to(self.device, non_blocking=True)
            y = self.train_y[index].to(self.device, non_blocking=True)
            # Gradients are reduced across ranks once per step, on the last micro-batch.
            with (self.ddp.no_sync() if i < chunks - 1 else contextlib.nullcontext()), batch_context(cfg.seed, step, offset + start, cfg.batch_size):
                loss_sum = F.cross_entropy(self.ddp(x), y, reduction="sum")
                (loss_sum * scale).backward()
            total = loss_sum.detach() if total is None else total + loss_sum.detach()
            if self.trace is not None:
                self.trace.write(json.dumps({"step": step, "offset": offset + start, "samples": micro.tolist(), "loss_sum": loss_sum.item()}) + "\n")
            start += len(micro)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        logits = self.model(self.val_x)
        self.model.train()
        return {
            "val_loss": F.cross_entropy(logits, self.val_y).item(),
            "val_accuracy": (logits.argmax(1) == self.val_y).float().mean().item(),
        }

    def write_progress(self, state: str) -> None:
        # A status for people and the scheduler, written often: no fsync on the training path.
        write_json_atomic(self.cfg.progress_path, {
            "state": state, "step": self.step, "steps": self.cfg.steps, "world_size": self.env.world_size,
            "metrics": self.latest, "updated": time.time(),
        }, durable=False)

    def train(self, should_stop: StopCheck | None = None, after_first_step: Callable[[], None] | None = None) -> dict[str, Any] | None:
        """Train to the end (returns the result) or until `should_stop` says so (returns None).

        `should_stop` is called on every rank at the same steps (it may be collective);
        `after_first_step` once, when the first step of this call has completed.
        """
        cfg = self.cfg
        started, start_step = time.time(), self.step
        shard_start, shard_stop = shard_bounds(cfg.batch_size, self.env.world_size, self.env.rank)
        local_samples = shard_stop - shard_start
        window_loss, window_steps, window_start = None, 0, time.perf_counter()
        progress_at = 0.0
        if self.is_rank0:
            self.write_progress("running")
        while self.step < cfg.steps:
            if should_stop is not None and self.step % cfg.control_every == 0 and self.step > start_step and should_stop(self.step):
                return None
            loss = self.train_step(self.step)
            self.step += 1
            self.last_step_at = time.time()
            if after_first_step is not None and self.step == start_step + 1:
                after_first_step()
            if self.is_rank0:
                window_loss = loss if window_loss is None else window_loss + loss
                window_steps += 1
                evaluate = self.step % cfg.eval_every == 0 or self.step == cfg.steps
                if evaluate or self.step % cfg.log_every == 0:
                    # Logged every log_every steps, as means over the window: reading the loss
                    # waits for the device, and a metric costs CPU on the training core.
                    now = time.perf_counter()
                    self.latest.update(train_loss=window_loss.item() / (window_steps * local_samples),
                                       lr=self.scheduler.get_last_lr()[0], step_time_s=(now - window_start) / window_steps)
                    window_loss, window_steps = None, 0
                    if evaluate:
                        self.latest.update(self.evaluate())
                    self.metrics.log(self.step, **self.latest)
                    window_start = time.perf_counter()  # an evaluation is not a training step
            if self.step % cfg.checkpoint_every == 0 and self.step < cfg.steps:
                self.save_checkpoint(blocking=False)
            if self.is_rank0 and self.step % cfg.log_every == 0 and self.last_step_at - progress_at >= PROGRESS_EVERY_S:
                self.write_progress("running")
                progress_at = self.last_step_at
        self.save_checkpoint(blocking=True)  # the final state is durable before the result says so
        if self.is_rank0 and "val_accuracy" not in self.latest:
            self.latest.update(self.evaluate())  # resumed from the final checkpoint: no step ran
        result = {
            "trial_id": cfg.trial_id, "steps": self.step, "world_size": self.env.world_size,
            "resumed_from_step": start_step, "wall_s": time.time() - started,
            "metrics": dict(self.latest),
            "checkpoint": str(self.checkpointer.root / f"step-{self.step:08d}"),
        }
        if self.is_rank0:
            self.write_progress("finished")
            write_json_atomic(cfg.result_path, result)
        return result

    def close(self) -> None:
        self.metrics.close()

