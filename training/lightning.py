"""A LightningModule as a function trial: one line of glue between Lightning and the trial context.

    def train(ctx, lr=1e-3):                           # training.target
        fit_lightning(ctx, MyModule(lr), MyData())      # or: trainer = campaign_trainer(ctx, ...); trainer.fit(...)

`campaign_trainer(ctx, **trainer_kwargs)` is an `L.Trainer` wired to the trial (`fit_lightning`
builds one and fits): it runs `ctx.steps` optimizer steps and starts from the trial's last
save by itself. What maps onto what (`CampaignCallback`):

- `self.log(...)` -> `ctx.report`: a Lightning logger of the trial's own takes what Lightning
  hands its loggers (every `log_every_n_steps`, validation, epoch ends) and reports it once per
  step, under the trainer's `global_step` (optimizer steps, the unit of `ctx.steps`): a step's
  training, validation and epoch-end values in one report, sent when the step is over.
- checkpoints -> `ctx.save` / `ctx.load`: every `save_every` steps (the spec's
  `training.checkpoint_every`), at the last step and when told to stop, Lightning's whole
  checkpoint (model, optimizers, schedulers, loops, callbacks) is taken at the step's end, as
  Lightning's own ModelCheckpoint takes it, and handed to `ctx.save` once that step's metrics
  are reported: a resume never starts past a step MLflow has not heard of, and the steps it
  replays are not logged twice (the metrics journal keeps the first value). The next launch
  loads it through Lightning's `ckpt_path` (a checkpoint IO of the trial's), so Lightning
  restores everything as it restores its own files.
- `ctx.should_stop()` -> `trainer.should_stop`: asked after every optimizer step (it is
  collective: every rank asks at the same steps); yes (pruned, the devices are wanted, the
  campaign is stopping: SIGTERM) takes a checkpoint and stops the trainer after that step
  (pruned: none, the trial is final).

Processes and DDP. A trial's processes already are a DDP world: torchrun, a warm worker or an
elastic agent started one process per leased device, chose its device and initialised the
process group. Lightning left to itself would start processes of its own for `devices > 1` (a
second world on the same devices, its own store and ports) or, seeing torchrun's variables,
expect to own the group's set-up. So the trainer gets a DDP strategy whose cluster environment
is the trial's context (rank, world size, device; it launches nothing) and whose process group
is the one that exists (Lightning's set-up returns early when one is initialised): the trial's N
devices train one DDP model, and sizing, leases, pruning and checkpoint-restart resizes stay
the campaign's, as for any function trial. A one-process trial, and the pre-flight `check`
(no process group), get Lightning's single-device strategy on `ctx.device`. `devices`,
`accelerator`, `strategy` and `num_nodes` are therefore the trial's (`resources.devices`), and
`min_steps`/`min_epochs` are refused: the campaign decides when a trial stops early.

Needs Lightning: `pip install -c constraints.txt -e '.[lightning]'`.
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # the optional extra is not installed
    raise ImportError(f"training.lightning needs PyTorch Lightning ({e}): install the extra with "
                      "`pip install -c constraints.txt -e '.[lightning]'`") from e

from training.function import FunctionError, TrialContext

# What a trial's checkpoint is called on its way through Lightning's save (`trainer.save_checkpoint`
# -> the strategy -> its checkpoint IO): taken in memory, then written by ctx.save. Any other
# path (a ModelCheckpoint of the user's) is a file, as Lightning writes it.
TRIAL_CHECKPOINT = "campaign-trial-checkpoint"
# Trainer arguments the trial decides: its processes and devices, and when it stops early.
TRIAL_OWNED = {
    "devices": "resources.devices", "num_nodes": "resources.devices", "accelerator": "the device the campaign gives each process",
    "strategy": "the trial's process group (DDP over its processes)", "max_steps": "training.steps",
    "min_steps": "the campaign (pruning, resizes, a stop)", "min_epochs": "the campaign (pruning, resizes, a stop)",
}


class TrialEnvironment(ClusterEnvironment):
    """The trial's processes as Lightning's cluster: ranks from the context, nothing launched,
    the process group already made (so main_address/port are never used to make one)."""

    def __init__(self, ctx: TrialContext):
        self.ctx = ctx

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self.ctx.world_size

    def set_world_size(self, size: int) -> None:
        pass  # Lightning's count (nodes x devices) would be wrong across nodes: the context's holds

    def global_rank(self) -> int:
        return self.ctx.rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self.ctx.local_rank

    def node_rank(self) -> int:
        return 0


class TrialCheckpoints(TorchCheckpointIO):
    """Lightning's checkpoint IO: the trial's checkpoint is held here for ctx.save (`taken`),
    and the one ctx.load found is what Lightning loads at `resume_path`; other paths are files."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: dict[str, Any] | None = None
        self.resume_path: str | None = None
        self.resume_state: dict[str, Any] | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if str(path) == TRIAL_CHECKPOINT:
            self.taken = checkpoint
        else:
            super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if self.resume_state is not None and str(path) == self.resume_path:
            return self.resume_state
        return super().load_checkpoint(path, weights_only=weights_only)


class TrialDDP(DDPStrategy):
    """DDP over the trial's processes and process group (see the module's docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # ctx.save is collective (each rank writes its part of the DCP checkpoint): every rank
        # hands its checkpoint on, where Lightning's DDP writes a file from rank 0 only.
        if str(filepath) == TRIAL_CHECKPOINT:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        else:
            super().save_checkpoint(checkpoint, filepath, storage_options)


class TrialLogger(Logger):
    """What Lightning logs, collected per step for the callback to report."""

    def __init__(self, callback: "CampaignCallback"):
        super().__init__()
        self.callback = callback

    @property
    def name(self) -> str:
        return "campaign"

    @property
    def version(self) -> str:
        return self.callback.ctx.trial_id

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass  # the campaign logs the trial's spec as its MLflow run's parameters

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.callback.collect(metrics)

    def finalize(self, status: str) -> None:
        self.callback.report_pending()


class CampaignCallback(pl.Callback):
    """Lightning's metrics, checkpoints and stop flag mapped onto the trial context (see the
    module's docstring). `campaign_trainer` adds it with the strategy and checkpoint IO it needs."""

    def __init__(self, ctx: TrialContext, save_every: int | None = None):
        self.ctx = ctx
        self.save_every = max(1, int(save_every or ctx.cfg.checkpoint_every))
        self.checkpoints = TrialCheckpoints()
        self.logger = TrialLogger(self)
        self.pending: tuple[int, dict[str, float]] | None = None  # the step being logged and its metrics so far
        self.saved_step: int | None = None  # the step of the newest save (or of the one resumed from)
        self.taken_step: int | None = None  # the step of `checkpoints.taken`
        self.last_step = -1  # the newest optimizer step seen at a batch's end
        self.trainer: pl.Trainer | None = None
        self._sigterm: Any = None

    # --- metrics ----------------------------------------------------------------------------
    def collect(self, metrics: dict[str, float]) -> None:
        trainer = self.trainer
        step, values = trainer.global_step, {k: float(v) for k, v in metrics.items()}
        if trainer.state.fn != TrainerFn.FITTING:  # validate/test after fit: reported as they come
            self.ctx.report(step, **values)
            return
        if self.pending is not None and self.pending[0] != step:
            self.report_pending()
        if self.pending is None:
            self.pending = (step, {})
        self.pending[1].update(values)

    def report_pending(self) -> None:
        if self.pending is not None:
            step, values = self.pending
            self.pending = None
            if values:
                self.ctx.report(step, **values)

    # --- the step's end, and the next step's start ------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.strategy.checkpoint_io is not self.checkpoints:
            raise FunctionError("training.target: CampaignCallback needs the trial's strategy and checkpoint IO: build the trainer "
                                "with training.lightning.campaign_trainer(ctx, ...) (or call fit_lightning(ctx, module, data))")
        self.trainer = trainer
        if self.logger not in trainer.loggers:
            trainer.loggers = [*trainer.loggers, self.logger]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning installs its own SIGTERM handler after this hook; it broadcasts from inside the
        # handler and ends fit with an exception. A trial's SIGTERM means "save where you are and
        # return" (the context's handler makes should_stop say yes): it is put back once training starts.
        if threading.current_thread() is threading.main_thread():
            self._sigterm = signal.getsignal(signal.SIGTERM)

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_sigterm()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_sigterm()
        self.checkpoints.resume_state = None  # restored: the loaded state's memory goes back
        self.last_step = trainer.global_step

    def _restore_sigterm(self) -> None:
        if self._sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_over()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self.last_step:  # a batch whose gradients are accumulated: the step is not over
            return
        self.last_step = step
        stop = self.ctx.should_stop()  # every rank, after every optimizer step
        if stop:
            trainer.should_stop = True
        if self.ctx.stopped_by_pruner:  # final: its state at the stop is not written (ctx.save), so not taken either
            return
        if stop or step % self.save_every == 0 or step >= trainer.max_steps:
            self._take(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.taken_step is None and self.saved_step != trainer.global_step and not self.ctx.stopped_by_pruner:
            self._take(trainer)  # training ended by max_epochs or a dataset's end, between saves
        self._step_over()

    def _take(self, trainer: pl.Trainer) -> None:
        """Lightning's checkpoint of this step, held until the step's metrics are reported. The
        tensors in it are the live ones: nothing changes them before the next optimizer step,
        and ctx.save copies them (staging) before that step starts."""
        trainer.save_checkpoint(TRIAL_CHECKPOINT, weights_only=False)
        self.taken_step = trainer.global_step

    def _step_over(self) -> None:
        """The previous step is over: its metrics reported, then its checkpoint saved."""
        self.report_pending()
        if self.checkpoints.taken is not None:
            checkpoint, step = self.checkpoints.taken, self.taken_step
            self.checkpoints.taken, self.taken_step = None, None
            self.ctx.save(step, checkpoint)
            self.saved_step = step


def campaign_trainer(ctx: TrialContext, save_every: int | None = None, **trainer_kwargs: Any) -> pl.Trainer:
    """An `L.Trainer` for this trial: `trainer_kwargs` are Lightning's, less those the trial
    decides (TRIAL_OWNED); its `fit` resumes from the trial's last save. Defaults from the spec:
    `max_steps` training.steps, `log_every_n_steps` training.log_every, validation every
    training.eval_every steps, checkpoints every training.checkpoint_every (`save_every`)."""
    owned = sorted(set(trainer_kwargs) & set(TRIAL_OWNED))
    if owned:
        raise FunctionError("training.target: " + "; ".join(f"Trainer({k}=...) is the trial's: {TRIAL_OWNED[k]}" for k in owned))
    cfg = ctx.cfg
    callback = CampaignCallback(ctx, save_every)
    defaults: dict[str, Any] = {
        "max_steps": ctx.steps, "max_epochs": -1, "log_every_n_steps": cfg.log_every,
        "logger": False,  # no lightning_logs/: the trial's logger is added by the callback (with any of yours)
        "enable_checkpointing": False,  # the trial's checkpoints replace Lightning's files
        "enable_progress_bar": False,  # train.log is a file: the report lines say the progress
        "enable_model_summary": not ctx.quiet, "default_root_dir": cfg.trial_dir,
    }
    if "val_check_interval" not in trainer_kwargs and "check_val_every_n_epoch" not in trainer_kwargs:
        defaults.update(val_check_interval=cfg.eval_every, check_val_every_n_epoch=None)  # steps, across epochs
    yours = trainer_kwargs.get("callbacks") or []
    kwargs = {**defaults, **trainer_kwargs, "callbacks": [*([yours] if isinstance(yours, pl.Callback) else yours), callback]}
    if ctx.world_size > 1:
        strategy = TrialDDP(parallel_devices=[ctx.device] * ctx.world_size, cluster_environment=TrialEnvironment(ctx),
                            checkpoint_io=callback.checkpoints)
    else:
        strategy = SingleDeviceStrategy(device=ctx.device, checkpoint_io=callback.checkpoints)
    with _quiet(ctx.quiet):
        trainer = pl.Trainer(accelerator="cuda" if ctx.device.type == "cuda" else "cpu", strategy=strategy, **kwargs)
    saved = ctx.load()  # every rank
    if saved is not None:
        callback.saved_step = saved[0]
        callback.checkpoints.resume_path, callback.checkpoints.resume_state = str(ctx.saved), saved[1]
        trainer.ckpt_path = str(ctx.saved)  # Lightning's own resume: Trainer.fit loads it through the trial's IO
    return trainer


def fit_lightning(ctx: TrialContext, module: pl.LightningModule, datamodule: pl.LightningDataModule | None = None,
                  train_dataloaders: Any = None, val_dataloaders: Any = None, save_every: int | None = None,
                  **trainer_kwargs: Any) -> pl.Trainer:
    """Fit `module` as this trial (see `campaign_trainer`); the trainer, fitted."""
    trainer = campaign_trainer(ctx, save_every, **trainer_kwargs)
    with _quiet(ctx.quiet):
        if datamodule is not None:
            trainer.fit(module, datamodule=datamodule)
        else:
            trainer.fit(module, train_dataloaders, val_dataloaders)
    return trainer


@contextmanager
def _quiet(quiet: bool) -> Iterator[None]:
    """A dry run (the campaign's pre-flight check) prints nothing of Lightning's on the campaign's console."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")] if quiet else []
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
