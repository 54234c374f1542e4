"""Goodput (Pollux, OSDI'21): throughput times statistical efficiency, with the batch chosen.

A `scaling: goodput` job may train with any global batch from its reference batch M0 up to
`max_batch` x M0. A batch s times M0 makes, per step, the progress of

    gain(s) = s (phi + 1) / (phi + s)

reference steps, where phi is the gradient noise scale in units of M0 (McCandlish et al.
2018; Pollux's EFFICIENCY): far below the noise scale a larger batch is as good as as many
small steps, far above it a step is worth little more than one. A step's time at n devices
over k nodes is

    T(n, k, s) = T(n, k, 1) + compute x (s - 1) / n

(`compute` is the reference batch's forward and backward on one device: it grows with the
samples each device takes, the rest does not). The rate of progress, reference steps per
second, is gain(s) / T(n, k, s); it peaks at

    s* = sqrt(phi x A / B),   A = T(n, k, 1) - compute / n,   B = compute / n,

clamped to [1, max_batch]: a closed form for the batch Pollux searches on a grid.

`GoodputView` turns a step-time model of the reference batch into the time per reference
step at the best batch, so any policy that reads step times (ours, Pollux) sizes a goodput
job by what it really gains from devices. Pure functions, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.types import StepTimeModel

# A goodput job's batch may grow to this many times its reference batch: Pollux's
# applications allow 32x (CIFAR-10, BERT, DeepSpeech2) to 64x (ImageNet, YOLOv3).
MAX_BATCH = 32.0


def gain(scale: float, noise_scale: float) -> float:
    """Reference steps of progress made by one step at `scale` times the reference batch."""
    if noise_scale <= 0:
        return 1.0  # no gradient noise: a larger batch buys nothing
    return scale * (noise_scale + 1.0) / (noise_scale + scale)


def best_scale(fixed: float, per_scale: float, noise_scale: float, max_batch: float) -> float:
    """The batch scale s in [1, max_batch] that maximises gain(s) / (fixed + per_scale x s)."""
    if per_scale <= 0 or noise_scale <= 0:
        return 1.0 if noise_scale <= 0 else max_batch
    return min(max(math.sqrt(noise_scale * max(fixed, 0.0) / per_scale), 1.0), max_batch)


def compute_term(model: StepTimeModel, devices: int) -> float:
    """The part of a reference step on `devices` devices that grows with each device's
    samples: the model's `compute / devices` where it has analytic parameters (analytic and
    online models), else the share of one device's step that two devices halve."""
    params = getattr(model, "params", None)
    if params is not None:
        return params[1] / devices
    t1, t2 = model.step_time(1, 1), model.step_time(2, 1)
    return max(2.0 * (t1 - t2), 0.0) / devices


def rate(model: StepTimeModel, devices: int, nodes: int, noise_scale: float, max_batch: float = MAX_BATCH) -> tuple[float, float]:
    """(reference steps per second, batch scale) at the best batch on `devices` over `nodes`."""
    step = model.step_time(devices, nodes)
    per_scale = min(compute_term(model, devices), step)
    scale = best_scale(step - per_scale, per_scale, noise_scale, max_batch)
    return gain(scale, noise_scale) / (step + per_scale * (scale - 1.0)), scale


@dataclass(frozen=True, slots=True)
class GoodputView:
    """A goodput job's time per reference step at the best batch: what a policy reads.

    `model` predicts the reference batch's step time (fitted online from what the job
    reports); `noise_scale` is the job's current gradient noise scale (measured by the
    trainer), in units of the reference batch.
    """

    model: StepTimeModel
    noise_scale: float
    max_batch: float = MAX_BATCH

    def step_time(self, devices: int, nodes: int = 1) -> float:
        return 1.0 / rate(self.model, devices, nodes, self.noise_scale, self.max_batch)[0]

    def batch_scale(self, devices: int, nodes: int = 1) -> float:
        return rate(self.model, devices, nodes, self.noise_scale, self.max_batch)[1]


@dataclass(frozen=True, slots=True)
class NoiseGrowth:
    """A job's gradient noise scale through training: from `start` to `end` (units of the
    reference batch), geometrically in the fraction of the work done, as the noise scale
    grows while the loss falls (McCandlish et al.; Pollux measures 10x and more)."""

    start: float
    end: float

    def at(self, progress: float) -> float:
        p = min(max(progress, 0.0), 1.0)
        if self.start <= 0 or self.end <= 0:
            return max(self.start + (self.end - self.start) * p, 0.0)
        return self.start * (self.end / self.start) ** p
