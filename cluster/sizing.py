"""Turn a trial into a device request: how many devices, how much memory on each.

`size_request` is pure. `measure_memory` makes the estimate behind `auto` from a short
measured dry run of the trial's model and batch: the bytes of the parameters, gradients
and optimizer state, plus the activations autograd actually saves for backward (counted
with saved-tensor hooks, under the trial's autocast), or the evaluation forward's peak of
live tensors where that is larger, times a safety margin; plus what stays on the device
whatever the step (the data set when the feed keeps it there, the CUDA context, cuBLAS's
workspaces). In data parallelism every device holds a whole replica and 1/n of the batch's
activations, so more devices shrink only the latter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, TypeVar, Union

from cluster.types import WHOLE_DEVICE, Inventory, Request
from training.errors import CampaignError

T = TypeVar("T")
DeviceCount = Union[int, tuple[int, int], Literal["auto"]]
SAFETY_MARGIN = 1.25  # allocator fragmentation, workspace buffers, the framework's own use
GPU_CONTEXT_BYTES = 512 * 2**20  # CUDA context and kernels, per process (outside PyTorch's allocator)
# cuBLAS workspaces, inside PyTorch's allocator: one per handle, and a step uses two (the
# forward's thread and autograd's device thread), 32 MiB each on Hopper by PyTorch's default.
# On an H200 (docs/gpu-proof/) SmallCNN's peak allocated was 68 MB where its tensors were
# 2 MB: the gap is these two workspaces' size (inferred, not measured apart).
GPU_WORKSPACE_BYTES = 2 * 32 * 2**20 + 4 * 2**20
# ...plus 4 MiB: on the H200 the allocator's small pool (blocks up to 1 MB) peaked at 3.5 MiB
# for SmallCNN at widths 8 and 16 alike, about 2.5 MiB above the small tensors the estimate
# counts (cuBLASLt's workspaces are 1 MiB blocks; the rest is inferred, not measured apart).
# Whether sharing a GPU pays (`packing_pays`): a process's start on a GPU (imports, CUDA
# context, first kernels) took ~8 s on the H200 before its first step, where a warm worker
# starts its next one-device trial in ~0.05 s; and an eager step costs at least ~15 us of
# host time per op dispatched (ResNet-20: 685 ops, 10 ms a step there).
GPU_PROCESS_START_S = 8.0
HOST_S_PER_OP = 15e-6


class SizingError(CampaignError):
    """A trial's size cannot be decided; the message names the trial and the fix."""


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # the whole global batch on one device
    margin: float = SAFETY_MARGIN
    overhead_bytes: int = 0  # per process, added after the margin (CUDA context, workspaces)
    eval_bytes: int = 0  # the evaluation forward's peak of live tensors (no grad), on one process
    ops_per_step: int = 0  # ops a forward and backward on the batch dispatch (the optimizer's few foreach ops aside)
    resident_bytes: int = 0  # per process, exact: the data set when the feed keeps it on the device

    def per_device(self, devices: int) -> int:
        replica = self.params_bytes + self.grads_bytes + self.optimizer_bytes
        # Evaluation runs between steps with the gradients still held, so the larger of the
        # two transient peaks counts, not their sum.
        transient = max(self.activations_bytes / devices, self.eval_bytes)
        return int(math.ceil((replica + transient) * self.margin)) + self.resident_bytes + self.overhead_bytes


@dataclass(frozen=True, slots=True)
class SizedRequest:
    """A trial's request with the range of sizes it accepts; `at(n)` is the packer's Request."""

    trial_id: str
    min_devices: int
    max_devices: int
    memory_for: tuple[int, ...]  # memory per device at min_devices, min_devices+1, ..., max_devices

    def at(self, devices: int) -> Request:
        return Request(self.trial_id, devices, self.memory_for[devices - self.min_devices])

    @property
    def sizes(self) -> range:
        return range(self.min_devices, self.max_devices + 1)


def size_request(
    trial_id: str,
    devices: DeviceCount,
    memory_gb: float | Literal["auto"] | None,
    inventory: Inventory,
    estimate: MemoryEstimate | None = None,
) -> SizedRequest:
    """Decide a trial's sizes and memory per device on this inventory.

    - memory unset: a whole device (exclusive), of any memory (`whole_devices`). A number:
      that many GiB per device, so trials may share a GPU. `auto`: the measured estimate at
      each size.
    - CPU slots are never shared: one process per core.
    - devices `auto`: the fewest devices of one node on which the estimate fits.
    """
    largest_node = max((sum(d.node == n for d in inventory.devices) for n in inventory.nodes), default=0)
    device_memory = max((d.memory_bytes for d in inventory.devices), default=0)
    needs_estimate = devices == "auto" or (memory_gb == "auto" and inventory.kind != "cpu")  # CPU slots are never shared
    if needs_estimate and estimate is None:
        raise SizingError(f"trial {trial_id!r}: `auto` sizing needs a memory estimate, and none could be made")

    if devices == "auto":
        fitting = [n for n in range(1, largest_node + 1) if estimate.per_device(n) <= device_memory]
        if not fitting:
            raise SizingError(
                f"trial {trial_id!r} needs an estimated {estimate.per_device(max(1, largest_node)) / 2**30:.2f} GiB per device "
                f"even on all {largest_node} devices of the largest node, which have {device_memory / 2**30:.2f} GiB: "
                "use a smaller batch or model, or declare larger devices"
            )
        low = high = fitting[0]
    elif isinstance(devices, tuple):
        low, high = devices
    else:
        low = high = devices

    sizes = range(low, high + 1)
    if inventory.kind == "cpu" or memory_gb is None:
        memory = [whole_devices(inventory, estimate.per_device(n) if estimate else None) for n in sizes]
    elif memory_gb == "auto":
        memory = [estimate.per_device(n) for n in sizes]
    else:
        memory = [int(memory_gb * 2**30)] * len(sizes)
    return SizedRequest(trial_id, low, high, tuple(memory))


def whole_devices(inventory: Inventory, need_bytes: int | None) -> int:
    """The memory per device of a request for whole devices that must each hold `need_bytes`
    (None: not known): WHOLE_DEVICE, any device, where the smallest device holds it; otherwise
    the largest device's memory, which only devices that large can give."""
    if need_bytes is None or need_bytes <= min((d.memory_bytes for d in inventory.devices), default=0):
        return WHOLE_DEVICE
    return max(d.memory_bytes for d in inventory.devices)


def device_seconds(estimate: MemoryEstimate, steps: int, passes_per_step: int = 1) -> float:
    """A lower bound of a trial's time on a GPU: every op it dispatches costs the host at
    least HOST_S_PER_OP (a small model's step is launch-bound; a large one is slower still)."""
    return steps * passes_per_step * estimate.ops_per_step * HOST_S_PER_OP


def packing_pays(trial_seconds: list[float], expected_trials: int) -> bool:
    """Whether trials that could share a GPU should. Packed, each needs a process of its own,
    started together (~GPU_PROCESS_START_S, contended); one at a time, a warm worker runs
    them back to back after one start. Sharing saves at most the trials' own time, so it
    pays only when their work in all outweighs a process's start."""
    if not trial_seconds:
        return False
    return sum(trial_seconds) / len(trial_seconds) * max(expected_trials, len(trial_seconds)) >= GPU_PROCESS_START_S


def start_size(request: SizedRequest, place: Callable[[int], T | None], others_waiting_min: int, free_devices: int) -> T | None:
    """Place a trial at the size to start it at now; None if not even its minimum fits.

    The largest size that fits while leaving enough free devices for the minimum of the
    trials queued behind it, so that one elastic trial does not take what the queue needs.
    `place(n)` places the trial at n devices and returns where, or None.
    """
    budget = max(request.min_devices, free_devices - others_waiting_min)
    for n in sorted(request.sizes, reverse=True):
        if n <= budget and (placed := place(n)) is not None:
            return placed
    return None


def measure_memory(model, example_input, example_target, loss_fn, optimizer_state_per_param: int, on_gpu: bool,
                   eval_input=None, autocast_dtype=None, resident_bytes: int = 0, eval_target=None) -> MemoryEstimate:
    """One forward/backward pass of `model` on the whole batch, counting what it keeps.

    `loss_fn`: a loss `(outputs, targets) -> scalar` or a training.outputs.Objective (the part of
    the model's output `model.output` names, or the model's own loss).
    `optimizer_state_per_param`: tensors of optimizer state per parameter (SGD with momentum:
    1, Adam: 2). `eval_input` (and `eval_target`, for a model that takes labels): an evaluation
    batch, whose no-grad forward's peak of live tensors is measured too. `autocast_dtype`: the
    trial's autocast (activations saved in it).
    `resident_bytes`: what the trial keeps on the device besides (its data set). Runs
    wherever the model's parameters are.
    """
    import contextlib

    import torch

    from training.outputs import as_objective

    objective = as_objective(loss_fn)
    device_type = next(model.parameters()).device.type
    cast = torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()

    saved = 0
    seen: set[int] = set()

    def pack(t: torch.Tensor):
        nonlocal saved
        key = t.untyped_storage().data_ptr()
        if key not in seen:  # a tensor saved twice is held once
            seen.add(key)
            saved += t.untyped_storage().nbytes()
        return t

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with op_count() as ops:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
            loss = objective(model, example_input, example_target)
        loss.backward()
    model.zero_grad(set_to_none=True)
    evaluation = 0
    if eval_input is not None:
        was_training = model.training
        model.eval()
        with torch.no_grad(), cast, live_peak() as live:
            objective.forward(model, eval_input, eval_target)
        model.train(was_training)
        evaluation = live.peak
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return MemoryEstimate(
        params_bytes=params, grads_bytes=trainable,
        optimizer_bytes=trainable * optimizer_state_per_param,
        activations_bytes=saved, overhead_bytes=GPU_CONTEXT_BYTES + GPU_WORKSPACE_BYTES if on_gpu else 0,
        eval_bytes=evaluation, resident_bytes=resident_bytes, ops_per_step=ops.count,
    )


def op_count():
    """A dispatch mode counting the ops that run under it (each one kernel launch, or more, on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _OpCount(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    return _OpCount()


def live_peak():
    """A dispatch mode that follows the bytes of the tensors ops create while they live
    (by their storage's reference count), and keeps the peak: what a no-grad forward holds
    at once, which saved-tensor hooks cannot see."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class _LivePeak(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, tuple[StorageWeakRef, int]] = {}
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
                del self.live[key]
            for t in tree_leaves(out):
                if hasattr(t, "untyped_storage"):
                    storage = t.untyped_storage()
                    if storage.data_ptr() and storage.data_ptr() not in self.live:
                        self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
            self.peak = max(self.peak, sum(size for _, size in self.live.values()))
            return out

    return _LivePeak()
