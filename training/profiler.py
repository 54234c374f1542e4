"""Per-layer profile of a model at a batch size on one device, and its tables.

Each leaf module (a module without children: Conv2d, Linear, ReLU, ...) gets one row:
its parameters, forward and backward FLOPs (torch.utils.flop_counter), the bytes it moves,
its arithmetic intensity, its measured forward and backward time, its share of the step
and whether the device's roofline makes it compute- or memory-bound.

How it measures, and why:
- One traced training step records every leaf's real inputs (with hooks). Each leaf is
  then re-run alone on those inputs, forward and backward, under a FLOP counter and a
  timer. Running a layer alone attributes its backward exactly (flop_counter's own module
  tracker credits backward FLOPs to the wrong module, and module backward hooks do not
  fire at the end of the first layer's backward), at the price of missing the cache state
  a layer sees inside a full step.
- Whole steps (forward with loss, backward, optimizer) are timed without hooks at the
  batch size and at fractions of it; the step-time prior (cluster/step_time_prior.py)
  fits compute time against the per-device batch from those points.
- On CPU the profile runs with one intra-op thread by default: one CPU slot of the
  cluster is one core, and that is the device DDP runs each rank on.

The data classes here are plain and JSON-friendly so that a profile can be stored as an
artifact and read back by code (the prior) that does not import torch.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from training.errors import CampaignError
from training.flops import mfu
from training.outputs import Objective, as_objective
from training.roofline import DevicePeaks, DeviceUnavailableError, check_device, cpu_threads, is_device_failure, is_out_of_memory

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "BatchTooLargeError", "BucketProfile", "DdpProfile", "DeviceUnavailableError", "LayerProfile", "LayerTraceError",
    "LinkEstimate", "ModelProfile", "ProfileError", "StepTiming", "profile_model", "to_markdown", "to_rich_table",
]


class ProfileError(CampaignError):
    """The model could not be profiled; the caller goes on without a profile."""


class LayerTraceError(ProfileError):
    """A layer failed on the example batch; the message names it."""


class BatchTooLargeError(ProfileError):
    """The batch does not fit in the device's memory; the message names device and layer."""


# --- plain data -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LayerProfile:
    """One leaf module over one training step (all its calls, if it is called twice)."""

    name: str  # qualified module name, e.g. "features.0"
    kind: str  # module class, e.g. "Conv2d"
    params: int
    forward_flops: int
    backward_flops: int
    weight_bytes: int
    activation_in_bytes: int
    activation_out_bytes: int
    gradient_bytes: int  # parameter gradients written by backward
    bytes_moved: int  # forward and backward, see _bytes_moved
    forward_s: float
    backward_s: float
    calls: int = 1

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def arithmetic_intensity(self) -> float:
        """FLOP per byte moved, forward and backward together."""
        return self.flops / self.bytes_moved if self.bytes_moved else 0.0

    @property
    def achieved_flops(self) -> float:
        return self.flops / self.time_s if self.time_s > 0 else 0.0

    def share(self, step_s: float) -> float:
        return self.time_s / step_s if step_s > 0 else 0.0

    def bound(self, peaks: DevicePeaks) -> str:
        """"compute" or "memory" by the device's ridge point; "none" for a layer that moves
        no data (a view such as Flatten)."""
        if self.flops == 0 and self.bytes_moved == 0:
            return "none"
        return peaks.bound(self.arithmetic_intensity)


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Median times of a whole training step at one batch size, measured without hooks."""

    batch_size: int
    forward_s: float  # model and loss
    backward_s: float
    optimizer_s: float
    step_s: float  # median of whole steps (not the sum of the medians)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    model: str  # class name
    device: str
    threads: int  # intra-op threads on CPU; 0 on a GPU
    batch_size: int
    layers: tuple[LayerProfile, ...]  # in forward execution order
    scaling: tuple[StepTiming, ...]  # whole steps at the batch size and fractions of it
    parameter_count: int
    gradient_bytes: int  # every parameter that requires grad: what DDP all-reduces

    @property
    def step(self) -> StepTiming:
        return next(s for s in self.scaling if s.batch_size == self.batch_size)

    def mfu(self, peaks: DevicePeaks) -> float:
        """Model FLOPs utilisation: the layers' FLOPs of one step over the measured step time,
        as a share of the device's measured peak (training.flops)."""
        return mfu(sum(l.flops for l in self.layers), self.step.step_s, peaks.peak_flops) if self.step.step_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        """Step time outside the leaf layers: loss, optimizer, framework overhead."""
        return max(0.0, self.step.step_s - sum(l.time_s for l in self.layers))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelProfile":
        d = dict(d)
        d["layers"] = tuple(LayerProfile(**l) for l in d["layers"])
        d["scaling"] = tuple(StepTiming(**s) for s in d["scaling"])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelProfile":
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True, slots=True)
class BucketProfile:
    """One DDP gradient bucket, in the order DDP all-reduces them (last layers first)."""

    index: int
    bytes: int
    params: tuple[str, ...]  # parameter names in the bucket


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """Ring all-reduce fitted as time = latency_s + ring_bytes / bandwidth, where ring_bytes
    = 2(n-1)/n of the buffer: what each device sends (and receives) in a ring all-reduce."""

    world_size: int
    bandwidth_bytes_per_s: float
    latency_s: float  # the whole all-reduce's fixed cost at this world size
    points: tuple[tuple[int, float], ...]  # (buffer bytes, median seconds) it was fitted on


@dataclass(frozen=True, slots=True)
class DdpProfile:
    """What training/profile_ddp.py measured at one world size (medians over its steps)."""

    model: str
    world_size: int
    backend: str
    global_batch: int
    steps: int
    buckets: tuple[BucketProfile, ...]
    allreduce_bytes: int  # per step and rank, all buckets
    allreduce_s: float  # per step: time some bucket's all-reduce was in flight
    overlap_s: float  # of that, the time backward was still computing
    step_s: float  # slowest rank
    forward_s: float
    backward_s: float  # includes waiting for the last all-reduce
    optimizer_s: float
    link: LinkEstimate | None  # None at world size 1
    peer_wait_s: float | None = None  # of allreduce_s, waiting for the slowest rank (one node only)
    corun_slowdown: float = 1.0  # a rank's compute with all ranks computing, over alone
    threads: int = 1

    @property
    def overlap_fraction(self) -> float:
        return self.overlap_s / self.allreduce_s if self.allreduce_s > 0 else 0.0

    @property
    def exposed_s(self) -> float:
        return self.allreduce_s - self.overlap_s

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "DdpProfile":
        d = json.loads(text)
        d["buckets"] = tuple(BucketProfile(b["index"], b["bytes"], tuple(b["params"])) for b in d["buckets"])
        if d["link"] is not None:
            link = d["link"]
            d["link"] = LinkEstimate(link["world_size"], link["bandwidth_bytes_per_s"], link["latency_s"], tuple(tuple(p) for p in link["points"]))
        return cls(**d)


# --- timing -----------------------------------------------------------------------------------

class _Timer:
    """Times callables on a device: perf_counter on CPU, CUDA events on a GPU (no host stalls
    inside the timed region)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def median(self, run: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None, warmup: int = 2) -> float:
        times = []
        for i in range(warmup + repeats):
            if setup is not None:
                setup()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                run()
                elapsed = time.perf_counter() - t0
            if i >= warmup:
                times.append(elapsed)
        return statistics.median(times)

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def between(self, a: Any, b: Any) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


# --- tracing: which leaf gets which inputs ------------------------------------------------------

def _tensors(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


@dataclass(slots=True)
class _Call:
    """One call of a leaf in the traced step: its inputs, detached, with their grad flags."""

    args: tuple
    kwargs: dict
    in_bytes: int
    out_bytes: int = 0

    def inputs(self, inplace: bool) -> tuple[tuple, dict, list[Tensor]]:
        """Fresh inputs for a standalone run: leaves that require grad where the step's did.
        Returns (args, kwargs, the grad-requiring leaf tensors)."""
        leaves: list[Tensor] = []

        def fresh(obj: Any) -> Any:
            if isinstance(obj, _Frozen):
                leaf = obj.value.clone() if inplace else obj.value
                if not obj.requires_grad:
                    return leaf
                leaf.requires_grad_(True)
                leaves.append(leaf)
                # An in-place layer cannot write into a leaf that requires grad (nor a view of
                # one): give it a copy made inside the graph.
                return leaf.clone() if inplace else leaf
            if isinstance(obj, (list, tuple)):
                return type(obj)(fresh(o) for o in obj)
            if isinstance(obj, dict):
                return {k: fresh(v) for k, v in obj.items()}
            return obj

        return fresh(self.args), fresh(self.kwargs), leaves


@dataclass(frozen=True, slots=True)
class _Frozen:
    """A recorded input tensor: its value, detached, and whether it required grad."""

    value: Tensor
    requires_grad: bool


def _freeze(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return _Frozen(obj.detach(), obj.requires_grad)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_freeze(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _freeze(v) for k, v in obj.items()}
    return obj


def _leaves(model: nn.Module) -> dict[str, nn.Module]:
    return {name or type(model).__name__: m for name, m in model.named_modules() if not any(True for _ in m.children())}


class _StepTracer:
    """Runs one hooked training step, recording each leaf's calls and the module in which an
    error happens (the innermost module entered and not yet left)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names = {m: (name or type(model).__name__) for name, m in model.named_modules()}
        self.leaves = set(_leaves(model).values())
        self.stack: list[nn.Module] = []
        self.calls: dict[str, list[_Call]] = {}

    def culprit(self) -> str:
        if not self.stack:
            return f"model {type(self.model).__name__}"
        m = self.stack[-1]
        return f"layer {self.names[m]} ({type(m).__name__})"

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.stack.append(module)
        if module in self.leaves:
            self.calls.setdefault(self.names[module], []).append(_Call(_freeze(args), _freeze(kwargs), _nbytes(args) + _nbytes(kwargs)))

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.stack.pop()
        if module in self.leaves:
            self.calls[self.names[module]][-1].out_bytes = _nbytes(output)

    def run(self, x: Tensor, y: Tensor, objective: Objective) -> None:
        handles = []
        for m in self.names:
            handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.append(m.register_forward_hook(self._post, with_kwargs=True))
        try:
            out = objective.forward(self.model, x, y)
        finally:
            for h in handles:
                h.remove()
        self.stack = [self.model]  # an error from here on belongs to the model as a whole
        loss = objective.loss(out, y)
        if not (isinstance(loss, Tensor) and loss.numel() == 1 and loss.requires_grad):
            raise LayerTraceError(f"loss_fn must return a scalar tensor that requires grad, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
        loss.backward()
        self.stack = []
        self.model.zero_grad(set_to_none=True)


# --- measurement --------------------------------------------------------------------------------

def _bytes_moved(weights: int, grads: int, act_in: int, act_out: int, input_grad: bool, has_backward: bool) -> int:
    """Minimal-traffic estimate: each tensor a layer touches is read or written once per pass.
    Forward reads weights and input, writes output. Backward reads the output's gradient,
    the saved input and the weights, writes the input's gradient (if needed) and the
    weight gradients."""
    forward = weights + act_in + act_out
    backward = (act_out + act_in + weights + (act_in if input_grad else 0) + grads) if has_backward else 0
    return forward + backward


def _is_view(out: Any, inputs: Any) -> bool:
    storages = {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
    outs = list(_tensors(out))
    return bool(outs) and all(o.untyped_storage().data_ptr() in storages for o in outs)


def _profile_leaf(name: str, module: nn.Module, calls: list[_Call], timer: _Timer, repeats: int) -> LayerProfile:
    params = list(module.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    inplace = bool(getattr(module, "inplace", False))
    fwd_flops = bwd_flops = bytes_moved = 0
    fwd_s = bwd_s = 0.0
    act_in = act_out = 0
    for call in calls:
        args, kwargs, input_leaves = call.inputs(inplace)
        with FlopCounterMode(display=False) as counter:
            out = module(*args, **kwargs)
        fwd_flops += counter.get_total_flops()
        outs = [t for t in _tensors(out) if t.requires_grad]
        grad_outs = [torch.ones_like(t) for t in outs]
        if outs:
            with FlopCounterMode(display=False) as counter:
                torch.autograd.backward(outs, grad_outs, retain_graph=True)
            bwd_flops += counter.get_total_flops()

        def clear_grads() -> None:
            for t in (*params, *input_leaves):
                t.grad = None

        # Time the forward on inputs of its own: an in-place layer rewrites them, which would
        # invalidate the graph that the backward timing below replays.
        f_args, f_kwargs, _ = call.inputs(inplace)
        fwd_s += timer.median(lambda: module(*f_args, **f_kwargs), repeats)
        if outs:
            bwd_s += timer.median(lambda: torch.autograd.backward(outs, grad_outs, retain_graph=True), repeats, setup=clear_grads)
        clear_grads()
        act_in += call.in_bytes
        act_out += call.out_bytes
        if inplace or not _is_view(out, (args, kwargs)):  # a reshape or a no-op moves no data
            bytes_moved += _bytes_moved(weights, grads, call.in_bytes, call.out_bytes, bool(input_leaves), bool(outs))
    return LayerProfile(
        name=name, kind=type(module).__name__, params=sum(p.numel() for p in params),
        forward_flops=int(fwd_flops), backward_flops=int(bwd_flops), weight_bytes=weights,
        activation_in_bytes=act_in, activation_out_bytes=act_out, gradient_bytes=grads, bytes_moved=bytes_moved,
        forward_s=fwd_s, backward_s=bwd_s, calls=len(calls),
    )


def _time_step(model: nn.Module, x: Tensor, y: Tensor, objective: Objective, optimizer: torch.optim.Optimizer, timer: _Timer, repeats: int, warmup: int = 3) -> StepTiming:
    fwd, bwd, opt, step = [], [], [], []
    for i in range(warmup + repeats):
        optimizer.zero_grad(set_to_none=True)
        t0 = timer.mark()
        loss = objective(model, x, y)
        t1 = timer.mark()
        loss.backward()
        t2 = timer.mark()
        optimizer.step()
        t3 = timer.mark()
        if i >= warmup:
            fwd.append(timer.between(t0, t1))
            bwd.append(timer.between(t1, t2))
            opt.append(timer.between(t2, t3))
            step.append(timer.between(t0, t3))
    med = statistics.median
    return StepTiming(len(x), med(fwd), med(bwd), med(opt), med(step))


def scaling_batch_sizes(batch_size: int, fractions: Iterable[int] = (1, 2, 4, 8)) -> tuple[int, ...]:
    """The batch and its halves, quarters, eighths (at least 1): per-device batches of 1..8 devices."""
    return tuple(sorted({max(1, batch_size // f) for f in fractions}, reverse=True))


def profile_model(
    model: nn.Module,
    example_batch: tuple[Tensor, Tensor],
    loss_fn: Objective | Callable[[Tensor, Tensor], Tensor],
    device: torch.device,
    repeats: int = 20,
    *,
    threads: int | None = 1,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> ModelProfile:
    """Profile a training step of `model` on `example_batch` (the trial's batch) on `device`.

    `loss_fn`: a loss `(outputs, targets) -> scalar` or a training.outputs.Objective (the
    part of the model's output `model.output` names, or the model's own loss).
    The model is copied; the caller's weights are not touched. `threads` is the intra-op
    thread count on CPU (None: leave the process setting). `optimizer` builds the trial's
    optimizer (default: SGD with momentum, as the trainer uses).
    Raises LayerTraceError (a layer fails; named), BatchTooLargeError (out of memory;
    device and layer named) or DeviceUnavailableError (device missing or lost; named).
    """
    device = check_device(device)
    x, y = example_batch
    objective = as_objective(loss_fn)
    make_optimizer = optimizer or (lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9))
    timer = _Timer(device)
    where = f"model {type(model).__name__}"
    try:
        with cpu_threads(threads if device.type == "cpu" else None):
            work = copy.deepcopy(model).to(device).train()
            x, y = x.to(device), y.to(device)
            tracer = _StepTracer(work)
            try:
                tracer.run(x, y, objective)
            finally:
                where = tracer.culprit()
            leaves = _leaves(work)
            layers = []
            for name, calls in tracer.calls.items():  # dicts keep the forward execution order
                where = f"layer {name} ({type(leaves[name]).__name__})"
                layers.append(_profile_leaf(name, leaves[name], calls, timer, repeats))
            where = f"model {type(model).__name__}"
            opt = make_optimizer(work.parameters())
            scaling = tuple(_time_step(work, x[:b], y[:b], objective, opt, timer, repeats) for b in scaling_batch_sizes(len(x)))
            threads_used = torch.get_num_threads() if device.type == "cpu" else 0
    except ProfileError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            raise BatchTooLargeError(
                f"a batch of {len(x)} does not fit in the memory of {device} ({where}): lower the batch size or profile on a device with more memory"
            ) from exc
        if is_device_failure(exc):
            raise DeviceUnavailableError(f"device {device} failed while profiling {where}: {exc}") from exc
        raise LayerTraceError(f"{where} cannot be profiled on a batch of shape {tuple(x.shape)}: {type(exc).__name__}: {exc}") from exc
    params = list(work.parameters())
    return ModelProfile(
        model=type(model).__name__, device=str(device), threads=threads_used, batch_size=len(x), layers=tuple(layers), scaling=scaling,
        parameter_count=sum(p.numel() for p in params),
        gradient_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
    )


# --- tables -------------------------------------------------------------------------------------

def _si(value: float, unit: str = "") -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip() if value else "0"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


COLUMNS = (
    "layer", "type", "params", "fwd FLOPs", "bwd FLOPs", "weights", "act in", "act out", "grads",
    "bytes moved", "FLOP/B", "fwd ms", "bwd ms", "share", "bound",
)


def table_rows(profile: ModelProfile, peaks: DevicePeaks) -> list[list[str]]:
    """The per-layer rows as text, then a row for the rest of the step and a total row."""
    step_s = profile.step.step_s
    rows = []
    for l in profile.layers:
        rows.append([
            l.name, l.kind, _si(l.params), _si(l.forward_flops), _si(l.backward_flops), _si(l.weight_bytes, "B"),
            _si(l.activation_in_bytes, "B"), _si(l.activation_out_bytes, "B"), _si(l.gradient_bytes, "B"), _si(l.bytes_moved, "B"),
            f"{l.arithmetic_intensity:.2f}", _ms(l.forward_s), _ms(l.backward_s), f"{l.share(step_s):.1%}", l.bound(peaks),
        ])
    rows.append(["(rest of step)", "loss, optimizer, framework"] + [""] * 11 + [f"{profile.other_s / step_s:.1%}" if step_s else "", ""])
    total = lambda attr: sum(getattr(l, attr) for l in profile.layers)  # noqa: E731
    rows.append([
        "total", "", _si(profile.parameter_count), _si(total("forward_flops")), _si(total("backward_flops")), _si(total("weight_bytes"), "B"),
        _si(total("activation_in_bytes"), "B"), _si(total("activation_out_bytes"), "B"), _si(profile.gradient_bytes, "B"), _si(total("bytes_moved"), "B"),
        "", _ms(profile.step.forward_s), _ms(profile.step.backward_s), "100%", "",
    ])
    return rows


def _caption(profile: ModelProfile, peaks: DevicePeaks) -> str:
    s = profile.step
    threads = f", {profile.threads} thread(s)" if profile.threads else ""
    return (
        f"{profile.model}, batch {profile.batch_size} on {profile.device}{threads}: step {_ms(s.step_s)} ms "
        f"(forward with loss {_ms(s.forward_s)}, backward {_ms(s.backward_s)}, optimizer {_ms(s.optimizer_s)}). "
        f"Device {peaks.name}: {peaks.peak_flops / 1e9:.1f} GFLOP/s, {peaks.peak_bytes_per_s / 1e9:.1f} GB/s, "
        f"ridge {peaks.ridge_intensity:.2f} FLOP/B. Model FLOPs utilisation {profile.mfu(peaks):.1%} of that peak. Layer times are measured one layer at a time; "
        f"total fwd/bwd ms are whole-step times."
    )


def _ddp_markdown(ddp: DdpProfile) -> str:
    lines = [
        "",
        f"DDP at {ddp.world_size} process(es) ({ddp.backend}), global batch {ddp.global_batch}: step {_ms(ddp.step_s)} ms, "
        f"all-reduce {_si(ddp.allreduce_bytes, 'B')} per step in {_ms(ddp.allreduce_s)} ms, "
        f"{ddp.overlap_fraction:.0%} of it overlapped with backward ({_ms(ddp.exposed_s)} ms exposed).",
    ]
    if ddp.peer_wait_s is not None:
        lines[-1] += f" Of the all-reduce time, {_ms(ddp.peer_wait_s)} ms was waiting for the slowest rank."
    if ddp.world_size > 1:
        lines[-1] += f" Ranks computing together were {ddp.corun_slowdown - 1:.0%} slower than alone."
    if ddp.link is not None:
        lines[-1] += f" Link fit: {ddp.link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, latency {ddp.link.latency_s * 1e6:.0f} us."
    lines += ["", "| bucket | bytes | params |", "|---:|---:|---|"]
    lines += [f"| {b.index} | {_si(b.bytes, 'B')} | {', '.join(b.params)} |" for b in ddp.buckets]
    return "\n".join(lines)


def to_markdown(profile: ModelProfile, peaks: DevicePeaks, ddp: DdpProfile | None = None) -> str:
    """The profile as a markdown table (for a Prefect or MLflow artifact)."""
    escape = lambda cell: cell.replace("|", "\\|")  # noqa: E731
    align = ["---", "---"] + ["---:"] * 12 + ["---"]
    lines = [_caption(profile, peaks), "", "| " + " | ".join(COLUMNS) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in table_rows(profile, peaks)]
    text = "\n".join(lines)
    return text + "\n" + (_ddp_markdown(ddp) + "\n" if ddp is not None else "")


# What a narrow terminal shows (80 columns): each layer's arithmetic intensity, its time and
# what bounds it; the FLOPs and bytes behind the ratio stay in profile.md.
NARROW_COLUMNS = ("layer", "type", "FLOP/B", "fwd ms", "bwd ms", "share", "bound")


def to_rich_table(profile: ModelProfile, peaks: DevicePeaks, width: int | None = None) -> "Table":
    """The profile as a rich table for the terminal: every column, or NARROW_COLUMNS without
    borders when every column would not fit in `width` (a column cut to 'f…' says nothing)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    def build(columns: tuple[str, ...], **style) -> Table:
        table = Table(title=_caption(profile, peaks), title_justify="left", **style)
        rows = table_rows(profile, peaks)
        keep = [COLUMNS.index(c) for c in columns]
        for column, k in zip(columns, keep):
            if column in ("layer", "type"):  # names wrap; figures are never cut
                table.add_column(column, overflow="fold")
            else:
                figures = max(len(row[k]) for row in rows)
                table.add_column(column, justify="left" if column == "bound" else "right", no_wrap=True,
                                 min_width=max(figures, *(len(word) for word in column.split())))
        for i, row in enumerate(rows):
            style_of = {"compute": "blue", "memory": "dark_orange"}.get(row[-1])
            table.add_row(*(row[k] for k in keep), style=style_of, end_section=i == len(rows) - 3)
        return table

    table = build(COLUMNS)
    if width is None or Console(width=10_000).measure(table).maximum <= width:
        return table
    return build(NARROW_COLUMNS, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
