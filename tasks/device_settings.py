"""Settings only some machines can honour, checked against the devices trials will get.

A spec asking for what the machine cannot do fails before anything runs (exit 2), naming
the field and what to do, instead of a trial that crashes later or silently does something
else:

- `resources.memory_gb` as a number shares a GPU by memory; CPU slots are whole cores,
  never shared (`auto` stays allowed: it shares where there is a GPU, so one spec serves
  both kinds of machine);
- `training.precision` bf16/fp16 needs autocast in that dtype on the device (bf16 on a
  GPU: compute capability 8.0 or newer);
- `training.compile` needs torch.compile's backend: a C++ compiler for CPU slots, Triton
  for GPUs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Callable, Sequence

from tasks.grid import Trial
from training.spec import CampaignSpec, SpecError

CXX = ("g++", "c++", "clang++")


def check_device_settings(spec: CampaignSpec, trials: Sequence[Trial], kind: str,
                          autocast_ok: Callable[[str, str], bool] | None = None) -> None:
    """Raise SpecError for the first setting the devices of `kind` ("gpu" or "cpu") cannot honour."""
    autocast_ok = autocast_ok or autocast_supported
    where = "GPUs" if kind == "gpu" else "CPU slots"
    memory = spec.resources.memory_gb
    if kind != "gpu" and isinstance(memory, (int, float)):
        raise SpecError(f"resources.memory_gb: {memory:g} GiB per device shares a GPU by memory, and this campaign trains on "
                        "CPU slots (whole cores, never shared): remove it, or write `auto` (it shares where there is a GPU)")
    for precision in sorted({t.spec.training.precision for t in trials} - {"fp32"}):
        if not autocast_ok("cuda" if kind == "gpu" else "cpu", precision):
            hint = " (bf16 needs compute capability 8.0 or newer)" if kind == "gpu" and precision == "bf16" else ""
            raise SpecError(f"training.precision: {precision} autocast is not available on this machine's {where}{hint}: "
                            "use fp32" + (" or fp16" if precision == "bf16" else ""))
    if any(t.spec.training.compile for t in trials) and (problem := compile_problem(kind)):
        raise SpecError(f"training.compile: {problem}: install it, or set compile: false")


def autocast_supported(device_type: str, precision: str) -> bool:
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return False
        return torch.cuda.is_bf16_supported() if precision == "bf16" else True
    try:  # a tiny product under autocast, as the trainer's step will run it
        with torch.autocast("cpu", dtype=dtype):
            out = torch.ones(2, 2) @ torch.ones(2, 2)
        return out.dtype == dtype
    except (RuntimeError, ValueError):
        return False


def compile_problem(kind: str, which: Callable[[str], str | None] = shutil.which) -> str | None:
    """Why torch.compile's default backend cannot build for `kind`, or None."""
    if kind == "gpu":
        return None if importlib.util.find_spec("triton") else "torch.compile on a GPU needs Triton (pip install triton)"
    compilers = ([os.environ["CXX"]] if os.environ.get("CXX") else []) + list(CXX)
    if not any(which(c) for c in compilers):
        return f"torch.compile on CPU slots needs a C++ compiler, and none of {', '.join(compilers)} is on PATH"
    return None
