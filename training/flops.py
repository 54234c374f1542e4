"""Model FLOPs utilisation: the FLOPs a training step's model needs, per second, over the device's peak.

The step's FLOPs are counted by `torch.utils.flop_counter` over one forward and backward pass
on the meta device: a copy of the model built there has shapes and no storage, so counting
costs no device memory, runs no kernel and leaves the trial's weights, buffers and random
streams untouched. The peak is measured (training.roofline), at the dtype the step's matrix
multiplies run in. Only model FLOPs count: what recomputation or padding adds is not useful work.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from training.graphs import tensors_in
from training.workload import move


def step_flops(build: Callable[[], torch.nn.Module], objective: Callable, x: Any, y: Any,
               model: torch.nn.Module | None = None) -> int:
    """FLOPs of one forward (with the loss) and backward pass of a model from `build` on the
    batch (x, y), counted on the meta device. A model the meta device cannot run (one that
    reads a value on the host, as transformers' attention masks do) is counted on a copy of
    `model` on its own device instead, on one sample, times the batch (a model's FLOPs grow
    with the batch, sample by sample), under forked random streams: the trial's state is untouched."""
    try:
        with torch.device("meta"):
            built = build()
        return _counted(built.to("meta").train(), objective, move(x, torch.device("meta")), move(y, torch.device("meta")))
    except (RuntimeError, NotImplementedError):
        if model is None:
            raise
    first = next(iter(tensors_in(x)))
    device = first.device
    one = lambda v: _first_sample(v)  # noqa: E731
    copy_ = copy.deepcopy(model).train()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        flops = _counted(copy_, objective, one(x), one(y))
    del copy_
    return flops * first.shape[0]


def _counted(model: torch.nn.Module, objective: Callable, x: Any, y: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        objective(model, x, y).backward()
    return int(counter.get_total_flops())


def _first_sample(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value[:1]
    if isinstance(value, (tuple, list)):
        return type(value)(_first_sample(v) for v in value)
    if isinstance(value, dict):
        return {k: _first_sample(v) for k, v in value.items()}
    return value


def mfu(flops_per_step: float, step_time_s: float, peak_flops: float) -> float:
    """The share of the device's peak that the model's FLOPs reach at this step time."""
    if step_time_s <= 0 or peak_flops <= 0:
        raise ValueError(f"MFU needs a positive step time and peak, got {step_time_s} s and {peak_flops} FLOP/s")
    return flops_per_step / step_time_s / peak_flops


def matmul_dtype(precision: str) -> torch.dtype:
    """The dtype a trial's matrix multiplies run in under its autocast: the peak to hold it against."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
