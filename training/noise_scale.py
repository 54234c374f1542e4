"""The gradient noise scale, measured while training (McCandlish et al. 2018, "An Empirical
Model of Large-Batch Training", App. A; Pollux, OSDI'21, uses it for statistical efficiency).

B_simple = tr(Σ) / |G|², in samples: Σ is the per-sample gradient covariance, G the true
gradient. Two gradients of the same step at batch sizes b_small < b_big give unbiased
estimates of both, since E|g_b|² = |G|² + tr(Σ) / b:

    |G|²  ≈ (b_big |g_big|² − b_small |g_small|²) / (b_big − b_small)
    tr(Σ) ≈ (|g_small|² − |g_big|²) / (1/b_small − 1/b_big)

Either estimate of one step is very noisy (and |G|²'s often negative), so each is smoothed
with an exponential moving average (debiased, as Adam's moments) and the noise scale is
the ratio of the two averages, not an average of ratios.

Where the two sizes come from is the trainer's business (training.trainer): each process's
gradient before DDP's all-reduce against the averaged one, the logical ranks' gradients
against their sum (exact reduction), or the first micro-batch's against the step's. Here:
the estimator, which keeps its state on the device and is read (one host-device sync) only
when `value` is called, and the DDP comm hook that measures the local gradient.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

# The averages' memory, in training steps: a measurement every k steps weighs 1 - exp(-k / H).
HORIZON_STEPS = 100.0


def decay_for(every: int, horizon: float = HORIZON_STEPS) -> float:
    """The per-measurement decay of an average spanning `horizon` steps, measured every `every`."""
    return math.exp(-every / horizon)


def harmonic_mean(sizes: Iterable[int]) -> float:
    """The small batch size to use when |g_small|² is the mean over batches of these sizes:
    E mean_i |g_i|² = |G|² + tr(Σ) mean_i(1 / b_i)."""
    sizes = list(sizes)
    return len(sizes) / sum(1.0 / b for b in sizes)


def squared_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Σ |t|² over the tensors, a scalar on their device (no host sync)."""
    return torch.stack(torch._foreach_norm([t for t in tensors if t is not None])).square().sum()


class NoiseScale:
    """Debiased moving averages of |G|² and tr(Σ): the averages on the device, updated with
    one fused op per measurement; their common debiasing weight on the host (it cancels in
    the noise scale)."""

    def __init__(self, device: torch.device, decay: float = decay_for(1)):
        self.decay = decay
        self.dtype = torch.float32 if device.type == "mps" else torch.float64
        self.state = torch.zeros(2, dtype=self.dtype, device=device)  # biased [|G|², tr(Σ)]
        self.weight = 0.0  # Σ (1 - decay) decay^k over the measurements: the debiasing divisor
        self._sizes: tuple[float, float] | None = None
        self._matrix: torch.Tensor | None = None
        self._pending: tuple | None = None  # a measurement waiting on its all-reduce (update's `after`)

    def _estimator(self, b_small: float, b_big: float) -> torch.Tensor:
        """The 2x2 matrix taking [|g_small|², |g_big|²] to one step's [|G|², tr(Σ)] estimates."""
        if self._sizes != (b_small, b_big):
            if not 0 < b_small < b_big:
                raise ValueError(f"the small batch ({b_small}) must be smaller than the big one ({b_big})")
            span = b_big - b_small
            inverse = 1.0 / (1.0 / b_small - 1.0 / b_big)
            rows = [[-b_small / span, b_big / span], [inverse, -inverse]]
            self._matrix = torch.tensor(rows, dtype=self.dtype, device=self.state.device)
            self._sizes = (b_small, b_big)
        return self._matrix

    def update(self, small_sq: torch.Tensor, b_small: float, big_sq: torch.Tensor, b_big: float,
               check_finite: bool = False, after=None) -> None:
        """One step's measurement: |g_small|² (or its mean over several small batches, with
        b_small their harmonic mean) and |g_big|², scalars on the device (no host sync).
        `check_finite`: skip a non-finite one (an fp16 step that overflowed) on the device.
        `after`: an async collective still writing small_sq; it is waited on at the next
        update or read, long done by then (the average is applied in order all the same)."""
        self.settle()
        if after is not None:
            self._pending = (after, small_sq, b_small, big_sq, b_big, check_finite)
        else:
            self._apply(small_sq, b_small, big_sq, b_big, check_finite)

    def settle(self) -> None:
        """Apply a measurement still waiting on its collective (before its process group goes)."""
        if self._pending is not None:
            work, *measurement = self._pending
            self._pending = None
            work.wait()
            self._apply(*measurement)

    def _apply(self, small_sq: torch.Tensor, b_small: float, big_sq: torch.Tensor, b_big: float, check_finite: bool) -> None:
        sq = torch.stack([small_sq, big_sq]).to(self.dtype)
        updated = torch.addmv(self.state, self._estimator(b_small, b_big), sq, beta=self.decay, alpha=1.0 - self.decay)
        self.state = torch.where(torch.isfinite(updated).all(), updated, self.state) if check_finite else updated
        self.weight = self.weight * self.decay + (1.0 - self.decay)

    def moments(self) -> tuple[float, float] | None:
        """(|G|², tr(Σ)) as averaged so far, or None before the first measurement (one host sync)."""
        self.settle()
        if self.weight <= 0.0:
            return None
        sqr, var = self.state.tolist()
        return sqr / self.weight, var / self.weight

    def value(self) -> float | None:
        """The noise scale B_simple in samples; None with no measurement yet, or while the
        averaged |G|² is not positive (the noise swamps the signal: no finite estimate)."""
        moments = self.moments()
        if moments is None or not moments[0] > 0.0:
            return None
        sqr, var = moments
        return max(var, 0.0) / sqr

    # Carried across a resize (Trainer.state_bytes): the averages do not depend on the batch.
    def state_dict(self) -> dict:
        self.settle()
        return {"state": self.state.detach().cpu(), "weight": self.weight}

    def load_state_dict(self, state: dict) -> None:
        self.state = state["state"].to(device=self.state.device, dtype=self.dtype)
        self.weight = float(state["weight"])


class LocalNorm:
    """A DDP comm hook: the all-reduce DDP does by default (each bucket times 1/world_size,
    then summed: the same multiplication as DDP's own reducer, so the same bits), and, on a
    step it is armed for, |bucket|² of this process's gradient before it is averaged,
    summed over the buckets into `sq` (on the device)."""

    def __init__(self, world_size: int, group=None):
        self.factor = 1.0 / world_size
        self.group = group
        self.armed = False
        self.sq: torch.Tensor | None = None

    def take(self) -> torch.Tensor | None:
        sq, self.sq, self.armed = self.sq, None, False
        return sq

    @staticmethod
    def hook(state, bucket):  # unannotated: DDP checks the annotations, which this module's are strings
        tensor = bucket.buffer()
        if state.armed:
            sq = torch.linalg.vector_norm(tensor).square()
            state.sq = sq if state.sq is None else state.sq + sq
        tensor.mul_(state.factor)
        work = dist.all_reduce(tensor, group=state.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
