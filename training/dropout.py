"""Dropout whose mask depends on the sample, not on the process that computes it.

nn.Dropout draws from each rank's generator, so the masks, and the result, change with
the number of processes. Here the trainer declares where the local batch sits in the
global batch of the step (`batch_context`); each layer draws the whole global batch's mask
from (seed, step, layer) and keeps its slice. Every world size, shard split and
micro-batching then applies the same mask to the same sample. Outside a context (a
profile, a notebook) it is ordinary dropout.
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
        seed = int(np.random.SeedSequence([ctx.seed, ctx.step, self.layer_id]).generate_state(1)[0])
        generator = torch.Generator().manual_seed(seed)
        noise = torch.rand((ctx.global_batch, *x.shape[1:]), generator=generator)
        keep = (noise[ctx.offset: ctx.offset + x.shape[0]] >= self.p).to(device=x.device, dtype=x.dtype)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer_id={self.layer_id}"
