"""Dropout whose mask depends on the sample, not on the process that computes it.

nn.Dropout draws from each rank's generator, so the masks, and the result, change with
the number of processes. Here the trainer declares where the local batch sits in the
global batch of the step (`batch_context`); each layer's mask for the step is one stream
of a counter-based generator (Philox) keyed by (seed, step, layer), laid out over the
global batch, and each process jumps straight to its own slice of it. Every world size,
shard split and micro-batching then applies the same mask to the same sample, and no
process draws numbers for samples it does not hold. Outside a context (a profile, a
notebook) it is ordinary dropout.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class BatchContext:
    seed: int
    step: int
    offset: int  # position of this local (micro-)batch in the global batch
    global_batch: int


_current: ContextVar[BatchContext | None] = ContextVar("batch_context", default=None)


@contextlib.contextmanager
def batch_context(seed: int, step: int, offset: int, global_batch: int) -> Iterator[None]:
    token = _current.set(BatchContext(seed, step, offset, global_batch))
    try:
        yield
    finally:
        _current.reset(token)


def raw_slice(key: list[int], start: int, count: int) -> np.ndarray:
    """Draws start .. start+count of the 64-bit stream keyed by `key`, without the ones
    before: Philox is counter-based, `advance(k)` skips k blocks of 4 draws."""
    bits = np.random.Philox(np.random.SeedSequence(key))
    bits.advance(start // 4)
    return bits.random_raw(start % 4 + count)[start % 4:]


def uniform_slice(key: list[int], start: int, count: int) -> np.ndarray:
    """The same draws as uniform floats in [0, 1)."""
    return (raw_slice(key, start, count) >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


class SampleDropout(nn.Module):
    """Dropout with per-sample masks from (seed, step, layer_id, global sample position)."""

    def __init__(self, p: float, layer_id: int):
        super().__init__()
        self.p, self.layer_id = p, layer_id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        ctx = _current.get()
        if ctx is None:
            return F.dropout(x, self.p, training=True)
        per_sample = x[0].numel()
        raw = raw_slice([ctx.seed, ctx.step, self.layer_id], ctx.offset * per_sample, x.numel())
        # Kept where the draw, as a fraction of 2**64, is at least p: no float conversion.
        keep = torch.from_numpy(raw >= np.uint64(int(self.p * 2**64))).reshape(x.shape).to(device=x.device, dtype=x.dtype)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer_id={self.layer_id}"
