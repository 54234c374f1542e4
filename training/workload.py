"""What a trial trains: its model, data, loss and optimizer, built from the spec's plain dicts.

Each part is a built-in chosen by name or a user's callable named by
`target: "package.module:callable"` with `kwargs`:

- model:     a callable returning a `torch.nn.Module` (`model.output` says which part of what it
             returns the loss takes: training.outputs; `training.hf:from_config` builds a
             Hugging Face model from its config);
- data:      a callable returning `(train, val)`, two map-style datasets whose items are
             `(input, target)`;
- loss:      a callable `(outputs, targets) -> scalar`, the mean over the batch's samples
             (a class such as `torch.nn:CrossEntropyLoss` is instantiated with the kwargs);
- optimizer: a `torch.optim` class by name, with its keyword arguments.

Targets are imported with the campaign's working directory on `sys.path`, as the trial's
processes (started there) import them. `check_workload` builds everything once and runs a
forward pass and a backward pass on two real samples, so that a wrong module, signature or dataset is
refused, naming its field, before a campaign starts. The trainer, sizing and the profiler
build their parts through the same functions.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset, default_collate

from training.config import LOADER_FIELDS
from training.errors import CampaignError
from training.outputs import AUTO, Loss, Objective


class WorkloadError(CampaignError):
    """A model, dataset, loss or optimizer cannot be built or does not fit the others."""


# --- targets ---------------------------------------------------------------------------

def import_target(target: str, field: str) -> Callable:
    """The callable named `package.module:attr` (attr may be dotted), or a WorkloadError
    that names `field` and what to fix."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise WorkloadError(f"{field}: {target!r} must be 'package.module:callable'")
    cwd = os.getcwd()
    if cwd not in sys.path:  # the trial's processes run here and find the same modules
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise WorkloadError(
            f"{field}: cannot import {module_name!r} ({e}); it must be installed or importable from {cwd} "
            "(the directory the campaign runs in)") from None
    except Exception as e:  # the user's module raised while being imported
        raise WorkloadError(f"{field}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise WorkloadError(f"{field}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise WorkloadError(f"{field}: {target!r} is a {type(obj).__name__}, not a callable")
    return obj


def call_target(fn: Callable, args: tuple, kwargs: dict[str, Any], field: str) -> Any:
    """fn(*args, **kwargs), with a signature mismatch reported against `field.kwargs`."""
    try:
        signature = inspect.signature(fn)
    except ValueError:  # no signature to inspect (some builtins): let the call decide
        signature = None
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:
            raise WorkloadError(f"{field}.kwargs: {_name(fn)} does not accept {_unknown(signature, kwargs)}: {e}") from None
    try:
        return fn(*args, **kwargs)
    except CampaignError:
        raise
    except Exception as e:
        raise WorkloadError(f"{field}: {_name(fn)}(**{kwargs!r}) raised {type(e).__name__}: {e}") from None


def _unknown(signature: inspect.Signature, kwargs: dict[str, Any]) -> list[str]:
    """The keyword arguments the signature has no place for (all of them if that is unclear)."""
    params = signature.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return sorted(kwargs)
    return sorted(k for k in kwargs if k not in params) or sorted(kwargs)


def _name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# --- model -----------------------------------------------------------------------------

def build_model(spec: dict[str, Any]) -> nn.Module:
    """The trial's model, on the CPU. `spec`: {"name": <built-in>, ...its fields} or
    {"target": "pkg.mod:factory", "kwargs": {...}}."""
    if "target" in spec:
        model = call_target(import_target(spec["target"], "model.target"), (), spec.get("kwargs") or {}, "model")
        if not isinstance(model, nn.Module):
            raise WorkloadError(f"model.target: {spec['target']} returned a {type(model).__name__}, not a torch.nn.Module")
        return model
    from training.models import MODELS

    return MODELS[spec["name"]](**{k: v for k, v in spec.items() if k != "name"})


# --- data ------------------------------------------------------------------------------

def build_datasets(spec: dict[str, Any]) -> tuple[Dataset, Dataset]:
    """(train, val) map-style datasets. Built-in: digits from the prepared .npz."""
    if "target" in spec:
        made = call_target(import_target(spec["target"], "data.target"), (), spec.get("kwargs") or {}, "data")
        if not (isinstance(made, (tuple, list)) and len(made) == 2):
            raise WorkloadError(f"data.target: {spec['target']} must return (train, val) datasets, got a {type(made).__name__}")
        for name, ds in zip(("train", "val"), made):
            if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
                raise WorkloadError(f"data.target: the {name} dataset of {spec['target']} is a {type(ds).__name__}: "
                                    "it must be map-style (__len__ and __getitem__)")
            if len(ds) == 0:
                raise WorkloadError(f"data.target: the {name} dataset of {spec['target']} is empty")
        return made[0], made[1]
    from training.data import load_digits_npz

    try:
        digits = load_digits_npz(spec["path"])
    except CampaignError:
        raise
    except Exception as e:  # not an .npz, a pickle inside one (refused: allow_pickle is off), missing arrays
        raise WorkloadError(f"data.path: {spec['path']} is not a prepared digits .npz ({type(e).__name__}: {e}); "
                            "write one with `python -m training.data --out PATH`") from None
    return (TensorDataset(torch.from_numpy(digits.train_x), torch.from_numpy(digits.train_y)),
            TensorDataset(torch.from_numpy(digits.val_x), torch.from_numpy(digits.val_y)))


@functools.lru_cache(maxsize=8)
def _datasets_cached(key: str) -> tuple[Dataset, Dataset]:
    return build_datasets(json.loads(key))


def datasets(spec: dict[str, Any]) -> tuple[Dataset, Dataset]:
    """build_datasets, once per distinct spec in this process (checks, sizing, profiles)."""
    return _datasets_cached(json.dumps(data_identity(spec), sort_keys=True, default=str))


def data_identity(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k not in LOADER_FIELDS}


def sample_batch(dataset: Dataset, count: int) -> tuple[Any, Any]:
    """`count` real samples (cycling over a small dataset), collated: (inputs, targets)."""
    items = [dataset[i % len(dataset)] for i in range(count)]
    return split_pair(default_collate(items))


def split_pair(batch: Any) -> tuple[Any, Any]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise WorkloadError("data: a sample must be a pair (input, target)")
    return batch[0], batch[1]


def move(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """A batch's inputs or targets on `device` (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, (tuple, list)):
        return type(value)(move(v, device, non_blocking) for v in value)
    if isinstance(value, dict):
        return {k: move(v, device, non_blocking) for k, v in value.items()}
    return value


# --- loss ------------------------------------------------------------------------------

def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; outputs (N, ..., C) against class targets (N, ...): sequence models too."""
    if outputs.dim() > 2:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
    return F.cross_entropy(outputs, targets)


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs, targets.to(outputs.dtype).reshape(outputs.shape))


LOSSES: dict[str, Loss] = {"cross_entropy": cross_entropy, "mse": mse}


def build_loss(spec: dict[str, Any]) -> Loss:
    """The mean loss over a batch's samples (the trainer scales it to the global batch)."""
    if "target" in spec:
        fn = import_target(spec["target"], "loss.target")
        kwargs = spec.get("kwargs") or {}
        if inspect.isclass(fn):  # torch.nn:CrossEntropyLoss and the like: an instance is the loss
            return call_target(fn, (), kwargs, "loss")
        if kwargs:
            signature = inspect.signature(fn)
            try:
                signature.bind_partial(**kwargs)
            except TypeError as e:
                raise WorkloadError(f"loss.kwargs: {_name(fn)} does not accept {_unknown(signature, kwargs)}: {e}") from None
            return functools.partial(fn, **kwargs)
        return fn
    return LOSSES[spec.get("name", "cross_entropy")]


def build_objective(model: dict[str, Any], loss: dict[str, Any]) -> Objective:
    """The loss of a step on the model's output: the part `model.output` names (training.outputs)
    under the loss section's loss, or the model's own loss (`output: loss`)."""
    output = model.get("output", AUTO)
    return Objective(None if output == "loss" else build_loss(loss), output)


# --- optimizer -------------------------------------------------------------------------

def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    cls = getattr(torch.optim, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer):
        valid = sorted(n for n, c in vars(torch.optim).items()
                       if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer)
        raise WorkloadError(f"optimizer.name: {name!r} is not a torch.optim optimizer; valid: {', '.join(valid)}")
    return cls


def build_optimizer(spec: dict[str, Any], params, lr: float) -> torch.optim.Optimizer:
    cls = optimizer_class(spec.get("name", "SGD"))
    return call_target(cls, (params,), {"lr": lr, **(spec.get("kwargs") or {})}, "optimizer")


# --- the check before anything runs ------------------------------------------------------

@dataclass(frozen=True)
class WorkloadCheck:
    train_samples: int
    val_samples: int
    input_shape: tuple[int, ...] | None  # of one sample, when the input is a tensor
    output_shape: tuple[int, ...]  # of one sample's output


def check_workload(model: dict[str, Any], data: dict[str, Any], loss: dict[str, Any], optimizer: dict[str, Any],
                   lr: float) -> WorkloadCheck:
    """Build every part and run one forward and backward pass and one optimizer step on two
    real samples (on the CPU); any mismatch becomes a WorkloadError naming the field."""
    train, val = datasets(data)
    for name, ds in (("train", train), ("val", val)):
        try:
            item = ds[0]
        except Exception as e:
            raise WorkloadError(f"data: the {name} dataset's item 0 raised {type(e).__name__}: {e}") from None
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise WorkloadError(f"data: a {name} sample must be a pair (input, target), got {_describe(item)}")
    try:
        x, y = sample_batch(train, 2)
    except CampaignError:
        raise
    except Exception as e:
        raise WorkloadError(f"data: two train samples do not collate into a batch ({type(e).__name__}: {e}); "
                            "every sample must have the same shapes") from None
    net = build_model(model)
    objective = build_objective(model, loss)
    try:
        raw = objective.forward(net, x, y)
    except Exception as e:
        called = "model(inputs, labels=targets) (model.output: loss)" if objective.model_loss else "the forward pass"
        raise WorkloadError(f"model: {called} on a batch of data samples (input {_describe(x)}) raised "
                            f"{type(e).__name__}: {e}; the model and the data do not fit each other") from None
    outputs = objective.predictions(raw)  # a ModelOutputError names model.output and what the output has
    _check_labels(train, val, y, outputs)
    try:
        value = objective.loss(raw, y)
    except CampaignError:
        raise
    except Exception as e:
        raise WorkloadError(f"loss: on the model's output {_describe(outputs)} and the targets {_describe(y)} it raised "
                            f"{type(e).__name__}: {e}") from None
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()):
        if objective.model_loss:
            raise WorkloadError(f"model.output: loss: the model's own loss must be a scalar float tensor (the mean over the "
                                f"batch), got {_describe(value)}")
        raise WorkloadError(f"loss: it must return a scalar float tensor (the mean over the batch), got {_describe(value)}")
    if not torch.isfinite(value).all():
        raise WorkloadError(f"loss: it is {value.item()} on two training samples: check the model's output and the targets")
    try:
        value.backward()
    except Exception as e:
        raise WorkloadError(f"loss: its backward pass raised {type(e).__name__}: {e}; does the model have trainable "
                            "parameters the loss depends on?") from None
    build_optimizer(optimizer, net.parameters(), lr).step()
    return WorkloadCheck(len(train), len(val), tuple(x.shape[1:]) if isinstance(x, torch.Tensor) else None,
                         tuple(outputs.shape[1:]) if isinstance(outputs, torch.Tensor) else ())


LABELS_SAMPLED = 512  # per dataset, spread over it, where its labels are not one tensor


def _labels(dataset: Dataset) -> torch.Tensor | None:
    """A TensorDataset's labels whole; else those of up to LABELS_SAMPLED samples spread over it."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[-1]
    n = len(dataset)
    picks = sorted({round(i * (n - 1) / max(LABELS_SAMPLED - 1, 1)) for i in range(min(n, LABELS_SAMPLED))})
    try:
        return torch.stack([torch.as_tensor(dataset[i][1]) for i in picks])
    except Exception:
        return None  # labels of other shapes: the loss on real batches says


def _check_labels(train: Dataset, val: Dataset, y: Any, outputs: Any) -> None:
    """Class labels (integer targets, one per output row) must lie in [0, the model's number of
    outputs): any other fails every trial at its first step. -100 is cross-entropy's ignored one."""
    if not (isinstance(y, torch.Tensor) and isinstance(outputs, torch.Tensor) and outputs.dim() >= 2
            and not y.is_floating_point() and y.dtype != torch.bool and tuple(y.shape) == tuple(outputs.shape[:-1])):
        return
    classes = outputs.shape[-1]
    for name, ds in (("train", train), ("val", val)):
        labels = _labels(ds)
        if labels is None or labels.is_floating_point() or labels.numel() == 0:
            continue
        bad = labels[((labels < 0) | (labels >= classes)) & (labels != -100)]
        if bad.numel():
            raise WorkloadError(f"data/model: the {name} dataset has label {int(bad.max() if (bad >= classes).any() else bad.min())} "
                                f"but the model has {classes} outputs (labels must be in [0, {classes})): "
                                "give the model as many outputs as the data has classes (model.kwargs), or check data")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}: (" + ", ".join(_describe(v) for v in value[:3]) + ")"
    return type(value).__name__


def dataset_bytes(dataset: Dataset) -> int | None:
    """Bytes of a TensorDataset's tensors (None for any other dataset: unknown without reading it)."""
    if isinstance(dataset, TensorDataset):
        return sum(t.numel() * t.element_size() for t in dataset.tensors)
    return None
