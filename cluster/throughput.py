"""Step-time models of data-parallel jobs: an analytic curve, a prior, an online fit.

All models implement `cluster.types.StepTimeModel`: the time of one step at `devices`
devices spread over `nodes` nodes, with the global batch fixed (so a result does not
depend on its size). The analytic form is

    T(n, k) = fixed + compute / n + a(n) * (intra if k == 1 else inter) + per_node * (k - 1)

with a(n) = 2 (n - 1) / n, the bytes a ring all-reduce moves per device relative to the
gradient size: compute splits over the devices, the all-reduce does not shrink, and it runs
over the slow network as soon as the job spans two nodes. Speed-up is therefore sub-linear
and drops when a job crosses a node boundary (Pollux, OSDI'21, fits a similar model).

`OnlineStepTime` starts from any prior (`prior_from_size` here, or the per-layer profile
prior of cluster/step_time_prior.py) and refits the analytic parameters to the step times
the trial reports, so predictions converge to what is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from cluster.types import StepTimeModel


def allreduce_factor(devices: int) -> float:
    """Ring all-reduce traffic per device, in gradient sizes: 0 alone, toward 2 when many."""
    return 2.0 * (devices - 1) / devices if devices > 1 else 0.0


def _features(devices: int, nodes: int) -> tuple[float, float, float, float, float]:
    a = allreduce_factor(devices)
    spread = nodes > 1
    return (1.0, 1.0 / devices, 0.0 if spread else a, a if spread else 0.0, float(max(nodes - 1, 0)))


@dataclass(frozen=True, slots=True)
class AnalyticStepTime:
    """The analytic step time of the module docstring; every term in seconds, >= 0."""

    fixed: float  # per-step work that does not split: optimizer, data loading, launch
    compute: float  # forward and backward of the global batch on one device
    intra: float  # one gradient all-reduce within a node
    inter: float  # one gradient all-reduce across nodes
    per_node: float = 0.0  # added latency per extra node (rendezvous, stragglers)

    def __post_init__(self) -> None:
        if min(self.fixed, self.compute, self.intra, self.inter, self.per_node) < 0:
            raise ValueError(f"step-time terms must be >= 0: {self}")
        if self.fixed + self.compute <= 0:
            raise ValueError("a step must take some time on one device")

    def step_time(self, devices: int, nodes: int = 1) -> float:
        if devices < 1 or not 1 <= nodes <= devices:
            raise ValueError(f"need 1 <= nodes <= devices, got devices={devices} nodes={nodes}")
        f = _features(devices, nodes)
        return (
            self.fixed * f[0]
            + self.compute * f[1]
            + self.intra * f[2]
            + self.inter * f[3]
            + self.per_node * f[4]
        )

    @property
    def params(self) -> tuple[float, float, float, float, float]:
        return (self.fixed, self.compute, self.intra, self.inter, self.per_node)

    def scaled(self, factor: float) -> AnalyticStepTime:
        return AnalyticStepTime(*(p * factor for p in self.params))


# The network is taken to be this many times slower than the links inside a node for an
# all-reduce (25-100 Gb/s Ethernet/IB against NVLink/PCIe, partly hidden by overlap).
NETWORK_SLOWDOWN = 5.0


# The prior of a job that asked for one device. Most such jobs are short (in Philly, 96%
# of one-device jobs use under 10 GPU-hours, which the Pollux artifact maps to small
# models), so it gains some speed on one node (2.8x on four devices) and loses it across
# nodes, where the all-reduce costs 5x more. A prior that is too optimistic costs more than
# one too cautious: every job it oversizes takes devices from a waiting one.
ONE_DEVICE = AnalyticStepTime(fixed=0.05, compute=0.95, intra=0.05, inter=0.05 * NETWORK_SLOWDOWN, per_node=0.01)


def prior_from_size(
    requested: int,
    devices_per_node: int,
    single_step_s: float = 1.0,
    efficiency: float = 0.75,
) -> AnalyticStepTime:
    """A prior when nothing was measured, from the job's requested size.

    A user who asks for `requested` devices expects it to pay off, so the prior's parallel
    efficiency at that size (packed on the fewest nodes) is at least `efficiency`, a
    quarter of the loss from work that does not split, the rest from communication. A job
    that asked for few devices gets `ONE_DEVICE`, the more optimistic of the two.
    """
    n = max(requested, 1)
    nodes = math.ceil(n / devices_per_node)
    if n == 1 or ONE_DEVICE.step_time(1, 1) / (n * ONE_DEVICE.step_time(n, nodes)) >= efficiency:
        return ONE_DEVICE.scaled(single_step_s)
    # With T(1, 1) = 1: n * T(n, k) = 1 / efficiency = 1 + fixed * (n - 1) + n * (comms).
    excess = 1.0 / efficiency - 1.0
    fixed = 0.25 * excess / (n - 1)
    if nodes > 1:
        per_node = 0.1 * excess / (n * (nodes - 1))
        intra = 0.65 * excess / n / (allreduce_factor(n) * NETWORK_SLOWDOWN)
    else:
        intra = 0.75 * excess / n / allreduce_factor(n)
        per_node = intra  # nothing measured it: as dear as one all-reduce within a node
    model = AnalyticStepTime(fixed, 1.0 - fixed, intra, intra * NETWORK_SLOWDOWN, per_node)
    return model.scaled(single_step_s)


def _prior_grid(max_devices: int, devices_per_node: int) -> list[tuple[int, int]]:
    """Configurations where a prior is sampled: a few sizes, packed and spread."""
    sizes = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, max_devices} & set(range(1, max_devices + 1)))
    grid = set()
    for n in sizes:
        packed = max(1, math.ceil(n / devices_per_node))
        grid.update((n, k) for k in {packed, min(n, packed + 1), min(n, 2 * packed)})
    return sorted(grid)


def _fit_ratio(a: np.ndarray, y: np.ndarray, w: np.ndarray, extra: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Non-negative parameters minimising weighted squared errors in ratio (about log error).

    Dividing residuals by the target alone would make predicting twice too slow far dearer
    than twice too fast; dividing by the geometric mean of target and fit treats both
    alike, and a few reweighted passes settle it. `extra` rows are appended unscaled.
    """
    from scipy.optimize import nnls  # here, not at the top: it costs a campaign's start 0.3 s, and most never fit

    scale = y
    for _ in range(3):
        rows, targets = a * (w / scale)[:, None], w * y / scale
        if extra is not None:
            rows, targets = np.vstack([rows, extra[0]]), np.concatenate([targets, extra[1]])
        theta, _ = nnls(rows, targets, maxiter=200)
        scale = np.sqrt(y * np.maximum(a @ theta, 1e-12 * y))
    return theta


class OnlineStepTime:
    """A step-time model refined from the step times a job reports at each size it ran.

    Any prior (an analytic one, or the per-layer profile's) is first read as analytic
    parameters theta0 (fitted on a grid of configurations). Each refit then finds the
    non-negative parameters that best match the measured means, each weighted by its
    number of reports, pulled toward theta0 by `prior_weight` reports' worth per parameter.
    theta0 is rescaled to the measured level at the smallest measured configuration, so one
    report fixes the scale (how fast the device computes) and the prior only the shape of
    what was not measured. At a measured configuration the prediction also moves to the
    measured mean as reports accumulate, so it converges there even where the analytic form
    does not fit exactly.

    Mutable (it accumulates reports); the refit is lazy and the prediction cheap, since the
    policy calls `step_time` many times per decision.
    """

    def __init__(
        self,
        prior: StepTimeModel,
        max_devices: int = 64,
        devices_per_node: int = 8,
        prior_weight: float = 0.5,
        local_weight: float = 1.0,
    ) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.local_weight = local_weight
        if isinstance(prior, AnalyticStepTime):
            theta0 = np.array(prior.params)
        else:
            grid = _prior_grid(max_devices, devices_per_node)
            times = np.array([prior.step_time(n, k) for n, k in grid])
            theta0 = _fit_ratio(np.array([_features(n, k) for n, k in grid]), times, np.ones(len(grid)))
        self._theta0 = theta0
        # The prior's uncertainty per parameter: its own size, but at least 30% of a
        # one-device step, since communication costs vary tenfold between models and a
        # term the prior puts near zero must still be free to grow.
        self._spread = np.maximum(theta0, 0.3 * (theta0[0] + theta0[1]))
        self._sums: dict[tuple[int, int], tuple[int, float]] = {}  # config -> (count, sum)
        self._fit: AnalyticStepTime | None = AnalyticStepTime(*(float(t) for t in theta0))

    def observe(self, devices: int, nodes: int, step_time: float) -> None:
        """Record one measured step time (seconds) at `devices` devices over `nodes` nodes."""
        if not (step_time > 0 and math.isfinite(step_time)):
            raise ValueError(f"a measured step time must be positive, got {step_time}")
        count, total = self._sums.get((devices, nodes), (0, 0.0))
        self._sums[(devices, nodes)] = (count + 1, total + step_time)
        self._fit = None

    @property
    def observations(self) -> dict[tuple[int, int], tuple[int, float]]:
        """Per configuration: (number of reports, mean step time)."""
        return {c: (n, s / n) for c, (n, s) in self._sums.items()}

    @property
    def params(self) -> tuple[float, float, float, float, float]:
        """The fitted analytic parameters (fixed, compute, intra, inter, per_node)."""
        return (self._fit or self._refit()).params

    def step_time(self, devices: int, nodes: int = 1) -> float:
        fit = self._fit or self._refit()
        predicted = fit.step_time(devices, nodes)
        seen = self._sums.get((devices, nodes))
        if seen is None:
            return predicted
        count, total = seen
        return (total + self.local_weight * predicted) / (count + self.local_weight)

    def _refit(self) -> AnalyticStepTime:
        configs = list(self._sums)
        a = np.array([_features(n, k) for n, k in configs])
        y = np.array([self._sums[c][1] / self._sums[c][0] for c in configs])
        w = np.sqrt(np.array([float(self._sums[c][0]) for c in configs]))
        level = self._level()
        # Pull rows: sqrt(prior_weight) * (theta - level * theta0) / (level * spread) ~ 0.
        pull = math.sqrt(self.prior_weight) / (level * self._spread)
        theta = _fit_ratio(a, y, w, (np.diag(pull), pull * level * self._theta0))
        if theta[0] + theta[1] <= 0:
            theta[1] = float(np.min(y))
        self._fit = AnalyticStepTime(*(float(t) for t in theta))
        return self._fit

    def _level(self) -> float:
        """Measured over prior step time at the smallest measured configuration.

        The smallest one is the least bent by communication, whose shape is what the prior
        most likely gets wrong; its scale (how fast the device computes) is what it cannot know.
        """
        n, k = min(self._sums)
        count, total = self._sums[(n, k)]
        prior_time = float(np.dot(_features(n, k), self._theta0))
        return (total / count) / prior_time


def mean_relative_error(model: StepTimeModel, truth: StepTimeModel, configs: Iterable[tuple[int, int]]) -> float:
    """Mean |model - truth| / truth over `configs`: how far a model is from the real curve."""
    errors = [abs(model.step_time(n, k) / truth.step_time(n, k) - 1.0) for n, k in configs]
    return sum(errors) / len(errors)
