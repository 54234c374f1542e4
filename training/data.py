"""The digits dataset and the sample order that makes training independent of world size.

The order is defined over *global* sample positions: position k of the run is sample
`perm(epoch)[k % n]` with `epoch = k // n` and a permutation drawn from (seed, epoch). Step s
trains on positions [s*B, (s+1)*B) split into contiguous shards, one per rank. So the data
position of a trial is just its step, every world size sees the same samples in the same
order, and a resume needs no sampler state beyond the step.
"""

from __future__ import annotations

import argparse
import io
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from training.errors import CampaignError
from training.files import write_atomic

VAL_FRACTION = 0.2
SPLIT_SEED = 0


@dataclass(frozen=True)
class Digits:
    train_x: np.ndarray  # (N, 1, 8, 8) float32 in [0, 1]
    train_y: np.ndarray  # (N,) int64
    val_x: np.ndarray
    val_y: np.ndarray


def prepare_digits(out: Path) -> Path:
    """Write sklearn's bundled digits (no download) as a train/val split in one .npz."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    n_val = int(len(y) * VAL_FRACTION)
    val, train = order[:n_val], order[n_val:]
    buf = io.BytesIO()
    np.savez(buf, train_x=x[train], train_y=y[train], val_x=x[val], val_y=y[val])
    write_atomic(out, buf.getvalue())
    return out


def load_digits_npz(path: str | Path) -> Digits:
    path = Path(path)
    if not path.exists():
        raise CampaignError(f"data file {path} does not exist: run `dvc repro prepare` (or `python -m training.data --out {path}`)")
    with np.load(path) as f:
        return Digits(f["train_x"], f["train_y"], f["val_x"], f["val_y"])


class SampleOrder:
    """Which dataset indices each step and rank train on; see the module docstring."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples = num_samples
        self.seed = seed

    @lru_cache(maxsize=4)
    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the dataset's indices in `epoch` (host: once an epoch)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_batch(self, step: int, batch_size: int) -> np.ndarray:
        return self.batch_at(step * batch_size, batch_size)

    def batch_at(self, start: int, batch_size: int) -> np.ndarray:
        """The indices at global positions [start, start + batch_size)."""
        epoch, offset = divmod(start, self.num_samples)
        if offset + batch_size <= self.num_samples:  # the common case: within one epoch, a view
            return self.permutation(epoch)[offset:offset + batch_size]
        positions = np.arange(start, start + batch_size)
        epochs, offsets = np.divmod(positions, self.num_samples)
        out = np.empty(batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.permutation(int(epoch))[offsets[mask]]
        return out


@lru_cache(maxsize=64)
def shard_bounds(batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of a rank's contiguous shard: np.array_split's split, the first
    batch_size % world_size ranks take one more."""
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def main() -> None:
    parser = argparse.ArgumentParser(description="Prepare sklearn's digits as an .npz train/val split.")
    parser.add_argument("--out", type=Path, default=Path("data/digits.npz"))
    args = parser.parse_args()
    prepare_digits(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
