"""A LightningModule as a campaign trial: an MLP on scikit-learn's handwritten digits (8x8
images bundled with scikit-learn: nothing to download).

The module and the data module are plain Lightning; `train` is the one line of glue
(`fit_lightning`): `self.log` goes to MLflow and the live table, the trial's checkpoints hold
Lightning's whole state, and pruning or a stop ends the fit after a save.
`examples/lightning/params.yaml` runs it; README.md beside this file says how.
"""

from __future__ import annotations

import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from training.lightning import fit_lightning

# The digits are in memory: loader processes would only cost start-up time.
warnings.filterwarnings("ignore", ".*does not have many workers.*")


class DigitsData(L.LightningDataModule):
    """1,797 digits, 80 % to train on and 20 % to validate on (a fixed split)."""

    def __init__(self, batch_size: int = 64, limit: int | None = None):
        super().__init__()
        self.batch_size, self.limit = batch_size, limit

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        cut = int(0.8 * len(x))
        train, val = order[:cut], order[cut:]
        if self.limit is not None:
            train, val = train[:self.limit], val[:self.limit]
        self.train_set, self.val_set = TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class DigitsClassifier(L.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 1e-3, dropout: float = 0.1, steps: int = 1000):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)  # averaged over the trial's processes
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}


def train(ctx, hidden: int = 64, lr: float = 1e-3, dropout: float = 0.1, batch_size: int = 64):
    """training.target: `batch_size` is the global batch, split over the trial's processes."""
    module = DigitsClassifier(hidden, lr, dropout, steps=ctx.steps)
    fit_lightning(ctx, module, DigitsData(max(1, batch_size // ctx.world_size)))


def check(ctx, hidden: int = 64, lr: float = 1e-3, dropout: float = 0.1, batch_size: int = 64):
    """training.check, the campaign's dry run: one step on two samples, one report, one save."""
    module = DigitsClassifier(hidden, lr, dropout, steps=ctx.steps)
    fit_lightning(ctx, module, DigitsData(2, limit=2), log_every_n_steps=1, num_sanity_val_steps=0)
