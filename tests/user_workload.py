"""A researcher's own workload, as a package in a folder of theirs: a model with BatchNorm
and nn.Dropout, a map-style dataset (not tensors: it goes through a DataLoader), and
deliberately wrong variants for the checks."""

from __future__ import annotations

import textwrap
from pathlib import Path

PACKAGE = "labwork"

NETS = '''
import threading

import torch
from torch import nn


class BNNet(nn.Module):
    """Conv -> BatchNorm -> ReLU -> Dropout -> Linear, for 1x8x8 digits."""

    def __init__(self, width=8, p=0.2, classes=10):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.Flatten(),
                                  nn.Dropout(p), nn.Linear(width * 64, classes))

    def forward(self, x):
        return self.body(x)


def make(width=8, p=0.2):
    return BNNet(width, p)


def five_classes(width=8, p=0.2):
    return BNNet(width, p, classes=5)


def wrong_input(width=8):
    return nn.Sequential(nn.Flatten(), nn.Linear(10, 10))  # digits have 64 features, not 10


def not_a_module():
    return "a string"


def wait_forever():
    """What a hung collective or a deadlocked data loader looks like from outside: no step ends."""
    threading.Event().wait()


class StallsAt(nn.Module):
    """A linear model whose training forward pass blocks for good at step `step` (0: never):
    the campaign's watchdog sees a stalled trial."""

    def __init__(self, step=0, classes=10):
        super().__init__()
        self.step, self.calls = step, 0
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, classes))

    def forward(self, x):
        if self.training:
            self.calls += 1  # one call per step (no gradient accumulation): call n is step n - 1
            if self.step and self.calls > self.step:
                wait_forever()
        return self.body(x)


def stalls_at(step=0):
    return StallsAt(step)


class HangsOnceGrown(nn.Module):
    """A linear model whose first training step on more than one process blocks for good, the
    first time only (`marker`, a file, says it did): a resize whose next generation hangs."""

    def __init__(self, marker, classes=10):
        super().__init__()
        self.marker = marker
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, classes))

    def forward(self, x):
        import os

        import torch.distributed as dist

        if self.training and dist.is_initialized() and dist.get_world_size() > 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            wait_forever()
        return self.body(x)


def hangs_once_grown(marker):
    return HangsOnceGrown(marker)


class RaisesAt(nn.Module):
    """A linear model whose training forward pass indexes out of bounds at step `step` (0:
    never): a bug in the user's own code, which no retry can fix."""

    def __init__(self, step=0, classes=10):
        super().__init__()
        self.step, self.calls = step, 0
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, classes))

    def forward(self, x):
        if self.training:
            self.calls += 1  # one call per step (no gradient accumulation): call n is step n - 1
            if self.step and self.calls > self.step:  # an IndexError, index 10 out of bounds for size 10
                torch.arange(10)[10]
        return self.body(x)


def raises_at(step=0):
    return RaisesAt(step)
'''

DATA = '''
import numpy as np
import torch
from torch.utils.data import Dataset


class Digits(Dataset):
    """Map-style over the prepared arrays: one sample at a time, as a file-backed dataset is read."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i]), int(self.y[i])


def make(path, limit=None):
    with np.load(path) as f:
        train = Digits(f["train_x"][:limit], f["train_y"][:limit])
        val = Digits(f["val_x"], f["val_y"])
    return train, val


def only_one(path):
    return make(path)[0]


class Dicts(Digits):
    def __getitem__(self, i):
        return {"image": torch.from_numpy(self.x[i]), "label": int(self.y[i])}


def dict_items(path):
    train, val = make(path)
    return Dicts(train.x, train.y), val
'''


def write_package(root: Path) -> Path:
    pkg = root / PACKAGE
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(textwrap.dedent(NETS))
    (pkg / "data.py").write_text(textwrap.dedent(DATA))
    return root


def workload(digits: Path, **model_kwargs) -> dict:
    """The TrialConfig fields of the good workload."""
    return {
        "model": {"target": f"{PACKAGE}.nets:make", "kwargs": {"width": 8, "p": 0.2, **model_kwargs}},
        "data": {"target": f"{PACKAGE}.data:make", "kwargs": {"path": str(digits)}, "workers": 1},
    }
