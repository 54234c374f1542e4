"""Dropout whose mask depends on the sample, not on the process that computes it.

nn.Dropout draws from each rank's generator, so the masks, and the result, change with
the number of processes. Here the trainer declares where the local batch sits in the
global batch of the step (`batch_context`); each layer's mask for the step is one stream
of a counter-based generator (SplitMix64 over the element index) keyed by (seed, step, layer), laid out over the
global batch, and each process jumps straight to its own slice of it. Every world size,
shard split and micro-batching then applies the same mask to the same sample, and no
process draws numbers for samples it does not hold. Outside a context (a profile, a
notebook) it is ordinary dropout.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from training.hashing import GAMMA, mix64, mix64_array


@dataclass(frozen=True, slots=True)
class BatchContext:
    seed: int
    step: int
    offset: int  # position of this local (micro-)batch in the global batch
    global_batch: int


_current: ContextVar[BatchContext | None] = ContextVar("batch_context", default=None)


class batch_context:  # noqa: N801 (used as a function: `with batch_context(...)`)
    """Declares, for the dropout layers of the forward pass inside it, where this local
    (micro-)batch sits in the step's global batch. A class rather than a generator-based
    context manager: it is entered on every step."""

    __slots__ = ("_context", "_token")

    def __init__(self, seed: int, step: int, offset: int, global_batch: int):
        self._context = BatchContext(seed, step, offset, global_batch)

    def __enter__(self) -> None:
        self._token = _current.set(self._context)

    def __exit__(self, *exc) -> None:
        _current.reset(self._token)


def mask_key(seed: int, step: int, layer_id: int) -> int:
    """The stream of one layer's masks at one step: a 64-bit hash of (seed, step, layer)."""
    return mix64(mix64(mix64(seed) + step) + layer_id)


def raw_slice(key: int, start: int, count: int) -> np.ndarray:
    """Draws start .. start+count of the 64-bit stream keyed by `key`, without the ones
    before: draw i is SplitMix64's output for state (key + i) * gamma, a pure function of i
    (counter-based), so any slice costs only its own length. Vectorized uint64 arithmetic,
    which wraps mod 2**64 by definition; no generator object to build per call."""
    z = np.arange(start, start + count, dtype=np.uint64)
    z += np.uint64(key)
    z *= np.uint64(GAMMA)
    return mix64_array(z)


def u16_slice(key: int, start: int, count: int) -> np.ndarray:
    """Draws start .. start+count of the stream read as 16-bit words (4 per 64-bit draw, in
    the host's byte order): a quarter of the hashing, resolution 1/65536 for a dropout rate."""
    words = raw_slice(key, start // 4, (start % 4 + count + 3) // 4)
    return words.view(np.uint16)[start % 4: start % 4 + count]


class SampleDropout(nn.Module):
    """Dropout with per-sample masks from (seed, step, layer_id, global sample position)."""

    def __init__(self, p: float, layer_id: int):
        super().__init__()
        if layer_id < 0:
            raise ValueError(f"dropout layer_id {layer_id} must be >= 0")
        self.p, self.layer_id = p, layer_id
        self._threshold = np.uint16(min(round(p * 2**16), 2**16 - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        ctx = _current.get()
        if ctx is None:
            return F.dropout(x, self.p, training=True)
        per_sample = x[0].numel()
        draws = u16_slice(mask_key(ctx.seed, ctx.step, self.layer_id), ctx.offset * per_sample, x.numel())
        # Kept where the draw, as a fraction of 2**16, is at least p; the kept are scaled by
        # 1 / (1 - p) in the same array, so autograd sees one multiplication.
        scaled = np.where(draws >= self._threshold, np.float32(1.0 / (1.0 - self.p)), np.float32(0.0))
        mask = torch.from_numpy(scaled).view(x.shape).to(device=x.device, dtype=x.dtype, non_blocking=True)
        return x * mask

    def extra_repr(self) -> str:
        return f"p={self.p}, layer_id={self.layer_id}"
