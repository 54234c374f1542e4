"""CUDA graphs for static steps, and batches copied to the GPU while the step before runs.

A small model's step on a GPU waits on the host: each of its hundreds of kernels is a Python
call, a dispatch and a launch of a few microseconds, longer than the kernel itself. A CUDA
graph records the step's kernels once and replays them with one launch; what a step then costs
the host is copying its batch into the graph's input buffers, one replay and the optimizer.

What the graph holds: the forward pass, the loss and the backward pass of the step's one
micro-batch (and, for `reduction: exact`, filing its gradient in its logical rank's slot and
the ordered sum). What stays outside: the optimizer's step, the loss scaler, gradient
clipping and the learning-rate schedule. torch.optim reads a tensor learning rate back on the
host (SGD: `alpha=-lr`), and a float one would be frozen into the graph at the value it had
when captured, so a schedule (the default: cosine) could not move it; Adam's `capturable`
would be written into every checkpoint's parameter groups. The optimizer is a handful of
`foreach` launches; the forward and backward are the hundreds.

Why `torch.cuda.graph` directly and not `torch.compile(mode="reduce-overhead")`: that needs
compilation (seconds to minutes per trial, for trials that are short), graphs only the
compiled module (not the loss or the gradient filing), and hands back outputs that the next
replay overwrites. Capturing here works with `training.compile` on or off (compiled kernels
are captured like any other once the warm-up has compiled them). bench/gpt2_bench.py
measures both ways on a GPU.

Randomness: the step seeds the device's generator for (seed, step, logical rank) before
each replay; a captured graph reads the generator's seed and offset at replay (PyTorch's
graph-safe philox state), so dropout draws what the eager step would draw.

Where a step cannot be captured (a CPU, several processes whose gradient all-reduce runs
between the backward's kernels, several micro-batches each seeded on the host, a trace that
reads each loss, shapes that change, an op that refuses capture), the step runs as before,
and the reason is printed once to the trial's log. `graph_plan` decides from plain values
(no device needed); `StepGraph` does the capturing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from training.workload import move

SETTINGS = ("auto", "on", "off")
# Eager steps before the capture: the first one compiles (training.compile), picks cuDNN's
# algorithms and creates cuBLAS's handles; the last one runs on the capture's stream, as
# PyTorch's recipe for whole-network capture does, so nothing is first created mid-capture.
EAGER_STEPS = 2


@dataclass(frozen=True, slots=True)
class GraphPlan:
    capture: bool
    reason: str  # why not, or what is captured: one line for the trial's log


def graph_plan(setting: str, device_type: str, world_size: int, micro_batches: int, trace: bool = False) -> GraphPlan:
    """Whether this attach's steps are captured (pure: the trainer asks it at each attach)."""
    if setting not in SETTINGS:
        raise ValueError(f"training.cuda_graphs: {setting!r} is not one of {', '.join(SETTINGS)}")
    if setting == "off":
        return GraphPlan(False, "training.cuda_graphs is off")
    if device_type != "cuda":
        return GraphPlan(False, f"a {device_type.upper()} device: CUDA graphs need a GPU")
    if world_size > 1:
        return GraphPlan(False, f"{world_size} processes: their gradients are reduced between the backward's kernels")
    if micro_batches > 1:
        return GraphPlan(False, f"{micro_batches} micro-batches a step (logical ranks or max_device_batch), each seeded on the host")
    if trace:
        return GraphPlan(False, "training.trace reads each micro-batch's loss on the host")
    return GraphPlan(True, "the step's forward and backward are replayed from a CUDA graph")


def _signature(tensor: Any) -> tuple | None:
    return (tuple(tensor.shape), tensor.dtype, tensor.device) if isinstance(tensor, torch.Tensor) else None


class StepGraph:
    """One step's captured forward and backward: its static input buffers, the graph, its loss.

    `run(x, y)` is the step's work on one micro-batch, returning its loss (on the device);
    the first EAGER_STEPS calls of `step` run it as it is, the next one captures it and every
    later one replays it. `failed` holds why capture was given up, once it is."""

    def __init__(self, device: torch.device, run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 drop_grads: Callable[[], None]):
        self.device, self.run, self.drop_grads = device, run, drop_grads
        self.graph = None
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.signature: tuple | None = None
        self.loss: torch.Tensor | None = None
        self.eager_left = EAGER_STEPS
        self.failed: str | None = None
        self.stream = torch.cuda.Stream(device)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def step(self, x: Any, y: Any) -> torch.Tensor:
        signature = (_signature(x), _signature(y))
        if self.failed is not None:
            return self.run(x, y)
        if None in signature:
            return self._give_up("a batch that is not two tensors", x, y)
        if self.captured:
            if signature != self.signature:
                return self._give_up(f"the batch's shapes changed ({self.signature[0][0]} -> {signature[0][0]}): dynamic shapes", x, y)
            self.inputs[0].copy_(x)
            self.inputs[1].copy_(y)
            self.graph.replay()
            return self.loss.clone()  # the graph's own output is overwritten by the next replay
        if self.signature is not None and signature != self.signature:
            return self._give_up(f"the batch's shapes changed ({self.signature[0][0]} -> {signature[0][0]}): dynamic shapes", x, y)
        self.signature = signature
        self.eager_left -= 1
        if self.eager_left > 0:
            return self.run(x, y)
        if self.eager_left == 0:
            return self._warm_up(x, y)
        return self._capture(x, y)

    def _warm_up(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The step before the capture, a real one, on the capture's stream (PyTorch's recipe:
        whatever a stream creates lazily, cuBLAS's workspace among them, exists before capture)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            loss = self.run(x, y)
        current.wait_stream(self.stream)
        return loss

    def _capture(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Record the step's kernels, then replay them for this step: capturing runs nothing,
        so the step's seed (set before) and its batch are those an eager step would use."""
        self.drop_grads()  # the captured backward writes each gradient afresh: none to add to
        self.inputs = (x.clone(), y.clone())
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                self.loss = self.run(*self.inputs)
        except Exception as exc:  # an op that cannot be captured (a host read, a CPU tensor...)
            self.loss = self.inputs = None
            self.drop_grads()
            first = str(exc).splitlines()[0] if str(exc) else ""
            return self._give_up(f"capture failed: {type(exc).__name__}: {first}", x, y)
        self.graph = graph
        self.graph.replay()
        return self.loss.clone()

    def _give_up(self, reason: str, x: Any, y: Any) -> torch.Tensor:
        """From here on every step runs eagerly; this one too."""
        self.failed = reason
        if self.graph is not None:
            self.graph = self.inputs = self.loss = None
            self.drop_grads()  # they were the graph's: the eager backward starts from none
        return self.run(x, y)

    def release(self) -> None:
        """Let the graph and its memory go (a detach, a load: a resize captures again)."""
        if self.graph is not None:
            self.drop_grads()
        self.graph = self.inputs = self.loss = None


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a batch (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)


def copied_ahead(batches: Iterator[tuple[Any, Any]], device: torch.device, streams: "Streams | None" = None) -> Iterator[tuple[Any, Any]]:
    """`batches` (in pinned host memory) on `device`, each copied on a side stream while the
    step before it runs: the copy of batch n+1 is queued before batch n is handed over, so
    it overlaps batch n's kernels instead of waiting in line before batch n+1's. The step's
    stream waits for the copy (`wait_stream`) and the batch's memory is marked as used by it
    (`record_stream`), so the allocator does not hand it out while the step still reads it."""
    streams = streams or Streams(device)
    side = streams.side()

    def load() -> tuple[Any, Any] | None:
        try:
            x, y = next(batches)
        except StopIteration:
            return None
        with streams.on(side):
            return move(x, device, non_blocking=True), move(y, device, non_blocking=True)

    ahead = load()
    while ahead is not None:
        current = streams.current()
        current.wait_stream(side)
        for tensor in tensors_in(ahead):
            streams.record(tensor, current)
        batch, ahead = ahead, load()
        yield batch


class Streams:
    """The CUDA stream calls `copied_ahead` makes (a test gives it a fake that records them)."""

    def __init__(self, device: torch.device):
        self.device = device

    def side(self):
        return torch.cuda.Stream(self.device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def on(self, stream):
        return torch.cuda.stream(stream)

    @staticmethod
    def record(tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)
