"""The DDP trainer: owns the loop; the Checkpointer owns saving.

Invariant (DESIGN.md #1): the result does not depend on the world size or on restarts.
- Each step trains on the same global batch (training.data.SampleOrder), split by rank.
- The loss is summed and scaled by world_size / global_batch, so DDP's gradient average
  equals the gradient of the mean loss over the global batch, even for uneven shards.
- Randomness (dropout) is reseeded every step from (seed, step, rank): the RNG state of a
  step is a function of the step, which the checkpoint stores.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

from training.checkpoint import Checkpointer
from training.config import TrialConfig
from training.data import SampleOrder, load_digits_npz
from training.files import write_json_atomic
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
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


class Trainer(Stateful):
    def __init__(self, cfg: TrialConfig, env: DistEnv, device: torch.device):
        self.cfg, self.env, self.device = cfg, env, device
        data = load_digits_npz(cfg.data_path)
        self.train_x, self.train_y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
        self.val_x, self.val_y = torch.from_numpy(data.val_x).to(device), torch.from_numpy(data.val_y).to(device)
        self.order = SampleOrder(len(self.train_y), cfg.seed)

        torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every run
        self.model = build_model(cfg.model, **cfg.model_kwargs).to(device)
        self.ddp = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg.schedule, cfg.warmup_steps, cfg.steps, s)
        )
        self.step = 0
        self.checkpointer = Checkpointer(cfg.checkpoint_dir, cfg.keep_checkpoints, env.rank, env.world_size)
        self.is_rank0 = env.rank == 0
        self.metrics = MetricsLogger(cfg.mlflow_tracking_uri, cfg.mlflow_run_id) if self.is_rank0 else MetricsLogger(None, None)
        self.latest: dict[str, float] = {}

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

    # --- the loop ----------------------------------------------------------------------
    def resume(self) -> int | None:
        return self.checkpointer.load_latest({"trainer": self})

    def train_step(self, step: int) -> float:
        batch = self.order.global_batch(step, self.cfg.batch_size)
        local = torch.from_numpy(SampleOrder.shard(batch, self.env.rank, self.env.world_size))
        x, y = self.train_x[local].to(self.device), self.train_y[local].to(self.device)
        torch.manual_seed(step_seed(self.cfg.seed, step, self.env.rank))
        loss_sum = F.cross_entropy(self.ddp(x), y, reduction="sum")
        (loss_sum * self.env.world_size / self.cfg.batch_size).backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum.item() / len(local)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        logits = self.model(self.val_x)
        self.model.train()
        return {
            "val_loss": F.cross_entropy(logits, self.val_y).item(),
            "val_accuracy": (logits.argmax(1) == self.val_y).float().mean().item(),
        }

    def _write_progress(self, state: str) -> None:
        write_json_atomic(self.cfg.progress_path, {
            "state": state, "step": self.step, "steps": self.cfg.steps, "world_size": self.env.world_size,
            "metrics": self.latest, "updated": time.time(),
        })

    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        started, start_step = time.time(), self.step
        if self.is_rank0:
            self._write_progress("running")
        while self.step < cfg.steps:
            t0 = time.perf_counter()
            loss = self.train_step(self.step)
            self.step += 1
            if self.is_rank0:
                self.latest.update(train_loss=loss, lr=self.scheduler.get_last_lr()[0], step_time_s=time.perf_counter() - t0)
                if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                    self.latest.update(self.evaluate())
                self.metrics.log(self.step, **self.latest)
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                self.checkpointer.save(self.step, {"trainer": self})
            if self.is_rank0 and (self.step % cfg.log_every == 0 or self.step == cfg.steps):
                self._write_progress("running")
        if self.is_rank0 and "val_accuracy" not in self.latest:
            self.latest.update(self.evaluate())  # resumed from the final checkpoint: no step ran
        result = {
            "trial_id": cfg.trial_id, "steps": self.step, "world_size": self.env.world_size,
            "resumed_from_step": start_step, "wall_s": time.time() - started,
            "metrics": dict(self.latest),
            "checkpoint": str(self.checkpointer.root / f"step-{self.step:08d}"),
        }
        if self.is_rank0:
            self._write_progress("finished")
            write_json_atomic(cfg.result_path, result)
        return result

    def close(self) -> None:
        self.metrics.close()
