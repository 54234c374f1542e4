"""The contract between whoever launches a trial and the trainer: one JSON file.

`flows/` builds it from the validated spec; a person can also write one by hand and run
`torchrun -m training.train --config trial.json`. It is plain data with no validation of
its own beyond types: the spec has already checked every value.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from training.layout import trial_files


# Keys of a trial's `data` that say how batches are fed, not which: not part of its identity.
LOADER_FIELDS = ("workers", "on_device")


@dataclass(frozen=True, slots=True)
class TrialConfig:
    trial_id: str
    seed: int
    # What to train (training.workload): plain dicts from the spec, built-in names or targets.
    model: dict[str, Any]  # {"name": "small_cnn", ...} or {"target": "pkg.mod:factory", "kwargs": {...}}
    data: dict[str, Any]  # {"path": "data/digits.npz"} or {"target": ..., "kwargs": ...}; + workers, on_device
    steps: int
    batch_size: int  # global: the same at every world size
    lr: float
    optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "SGD", "kwargs": {"momentum": 0.9}})
    loss: dict[str, Any] = field(default_factory=lambda: {"name": "cross_entropy"})
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; fp16 with a gradient scaler)
    grad_clip_norm: float | None = None
    compile: bool = False  # torch.compile the model
    cuda_graphs: str = "auto"  # auto | on | off: the step replayed from a CUDA graph where it can be (training.graphs)
    # The data-parallel width the result is defined for: each step's global batch is split
    # into this many logical ranks, whatever the number of processes (training.batches).
    logical_ranks: int = 1
    # reproducible: the batch is fixed, results do not depend on the schedule. goodput: the
    # batch follows the process count (batch_size is the batch at logical_ranks processes,
    # so each process keeps its share), the learning rate is scaled with it (lr_scaling:
    # linear or sqrt), and the trial's length is steps x batch_size samples (schedule and
    # warm-up count samples too). A resize then costs no accumulation; the result depends on
    # when the trial was resized, and each resize's batch and lr are in resizes.jsonl.
    scaling: str = "reproducible"
    lr_scaling: str = "linear"
    # goodput: the batch may grow to this for goodput, as the scheduler chooses from the
    # measured noise scale (batch.json in the trial folder); None: the batch follows the size.
    max_batch_size: int | None = None
    reduction: str = "fast"  # fast: DDP's all-reduce (equal to rounding); exact: summed in logical order (bit for bit)
    schedule: str = "cosine"  # "cosine" or "constant"
    warmup_steps: int = 0
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 10
    # Steps between measurements of the gradient noise scale (training.noise_scale); None:
    # log_every (the step before each log step), 0: never.
    noise_scale_every: int | None = None
    eval_every: int = 50
    max_device_batch: int | None = None  # micro-batch limit per process: gradient accumulation above it
    async_checkpoints: bool = True  # periodic checkpoints written off the training path
    control_every: int = 10  # steps between checks for a resize request (elastic trials)
    trace: bool = False  # audit: record the samples and loss of every step of every process
    # A trial across nodes under torchrun (a pool's elastic trial): every rank stops at a
    # checkpoint at the first control step after this file appears (a resize moves it).
    stop_path: str | None = None
    hold_at_step: int | None = None  # tests: wait before this step (and each control step after) while `hold` exists in trial_dir
    # The campaign's watchdog (tasks/watchdog.py): seconds without progress before the trial counts as
    # stalled, "auto" (derived from its measured step time) or None (never). The trainer does not read it.
    stall_timeout_s: float | str | None = "auto"
    pruning: dict[str, Any] | None = None  # early stopping: the study to report to (training.pruning.Pruning)
    trial_dir: str = "."  # checkpoints, progress and result files live here
    mlflow_tracking_uri: str | None = None
    mlflow_run_id: str | None = None  # the trial's child run; None: no MLflow logging
    tags: dict[str, str] = field(default_factory=dict)
    lease: dict[str, Any] | None = None  # the holder's lease its workers watch (training.fence); None: run by hand
    # {"url": a DVC remote, "key": "<campaign>/<trial>"}: checkpoints pushed there and pulled from
    # there on a resume (training.checkpoint_remote); None: they stay in trial_dir only
    checkpoint_remote: dict[str, Any] | None = None
    # Rank 0 writes every replicated item of a checkpoint (all of a DDP trainer's state): a trial
    # across nodes that share no folder then has its whole checkpoint on rank 0's node, which
    # pushes it to the remote; the other nodes pull it to resume. False: DCP spreads the writes.
    one_checkpoint_writer: bool = False
    # A function trial (training.function): {"target": "pkg.mod:fn", "kwargs": {...}} runs the
    # user's own loop instead of ours; `point` is the trial's whole spec, handed to it as ctx.config.
    function: dict[str, Any] | None = None
    point: dict[str, Any] | None = None

    @property
    def goodput(self) -> bool:
        return self.scaling == "goodput"

    def batch_at(self, world_size: int) -> int:
        """The global batch at `world_size` processes: fixed, or (goodput) each process's
        share of batch_size at logical_ranks processes, times the processes."""
        if not self.goodput:
            return self.batch_size
        return max(world_size, round(self.batch_size * world_size / self.logical_ranks))

    def lr_scale(self, batch_size: int) -> float:
        """The learning rate's multiplier at `batch_size` (goodput): linear or square-root scaling."""
        ratio = batch_size / self.batch_size
        return ratio if self.lr_scaling == "linear" else ratio ** 0.5

    @property
    def total_samples(self) -> int:
        return self.steps * self.batch_size

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_file(cls, path: str | Path) -> "TrialConfig":
        from training.files import read_json

        raw = read_json(Path(path))
        if not isinstance(raw, dict):
            raise FileNotFoundError(path) if raw is None else TypeError(f"{path}: a trial config is a JSON object")
        return cls(**raw)

    @property
    def checkpoint_dir(self) -> Path:
        return trial_files(self.trial_dir).checkpoints

    @property
    def progress_path(self) -> Path:
        return trial_files(self.trial_dir).progress

    def chosen_batch(self, world_size: int, chosen: int | None) -> int:
        """The global batch at `world_size`: `batch_at`, or the batch the scheduler chose for
        goodput, kept within [batch_at(world_size), max_batch_size]."""
        batch = self.batch_at(world_size)
        if not self.goodput or not self.max_batch_size or not chosen:
            return batch
        return max(batch, min(int(chosen), self.max_batch_size))

    @property
    def result_path(self) -> Path:
        return trial_files(self.trial_dir).result
