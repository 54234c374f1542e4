"""Which part of a model's output the loss takes (`model.output`), so that a model returning a
tuple, a dict or a Hugging Face `ModelOutput` trains as one returning a tensor does.

- `auto` (default): a tensor as it is; a tuple or list: its first element; a dict or a
  `ModelOutput`: its `logits` (a `ModelOutput` is a dict whose first element is the loss when
  the model computed one, so "the first element" would be the wrong rule for it);
- `logits`, or any other name: that attribute or key of the output;
- `loss`: the model computes its own loss: it is called as `model(inputs, labels=targets)`
  (the Hugging Face convention) and its output's `loss` is what is trained; the spec's `loss`
  section is then not used, and evaluation reports `val_loss` only (the model may shift the
  labels as it likes, so its logits are not compared with the targets).

Everything that runs the model for a loss goes through one `Objective`: the train step and
evaluation (training.trainer), the check before a campaign (training.workload), memory sizing
(cluster.sizing), the profiler and its DDP part (training.profiler, training.profile_ddp).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor

from training.errors import CampaignError

AUTO, MODEL_LOSS = "auto", "loss"
Loss = Callable[[Any, Tensor], Tensor]
_MISSING = object()


class ModelOutputError(CampaignError):
    """The model's output has no tensor where model.output points; the message says what it has."""


def _kind(raw: Any) -> str:
    return "a tensor" if isinstance(raw, Tensor) else f"a {type(raw).__name__}"


def _parts(raw: Any) -> list[str]:
    """The names an output offers: a dict's keys (a ModelOutput's fields that are set), a named tuple's fields."""
    if isinstance(raw, Mapping):
        return [str(k) for k in raw.keys()]
    fields = getattr(raw, "_fields", None)
    if isinstance(fields, tuple):
        return list(fields)
    return sorted(k for k, v in vars(raw).items() if isinstance(v, Tensor)) if hasattr(raw, "__dict__") else []


def _part(raw: Any, name: str) -> Any:
    if isinstance(raw, Mapping):
        if name in raw:
            return raw[name]
        return getattr(raw, name, _MISSING)  # a ModelOutput's field that is None is not among its keys
    return _MISSING if isinstance(raw, Tensor) else getattr(raw, name, _MISSING)


def _listed(names: list[str]) -> str:
    return ", ".join(names) if names else "none"


def pick(raw: Any, output: str = AUTO) -> Tensor:
    """The tensor of the model's output `raw` that the loss takes, as `model.output` says;
    a ModelOutputError naming the field and what the output has otherwise."""
    if output == AUTO:
        if isinstance(raw, Tensor):
            return raw
        if isinstance(raw, Mapping):
            value = _part(raw, "logits")
            if value is _MISSING or value is None:
                raise ModelOutputError(
                    f"model.output: auto takes the `logits` of a dict output, and the model returned {_kind(raw)} without "
                    f"one (its parts: {_listed(_parts(raw))}): set model.output to the part the loss takes, or to loss "
                    "if the model computes its own loss")
            return _tensor(value, "`logits`", raw)
        if isinstance(raw, (tuple, list)):
            if not raw:
                raise ModelOutputError(f"model.output: the model returned an empty {type(raw).__name__}: it must return a tensor")
            return _tensor(raw[0], "the first element", raw)
        raise ModelOutputError(
            f"model.output: the model returned {_kind(raw)}; auto takes a tensor, a tuple's first element or a dict's "
            f"`logits`: set model.output to the attribute that holds the predictions (its tensors: {_listed(_parts(raw))})")
    if isinstance(raw, Tensor):
        raise ModelOutputError(f"model.output: {output!r} names a part of the model's output, and the model returned a "
                               "tensor: leave model.output out (auto)")
    value = _part(raw, output)
    if value is _MISSING:
        raise ModelOutputError(f"model.output: the model returned {_kind(raw)} without {output!r} (its parts: "
                               f"{_listed(_parts(raw))}): set model.output to one of them, or to auto")
    return _tensor(value, repr(output), raw)


def _tensor(value: Any, what: str, raw: Any) -> Tensor:
    if value is None:  # a ModelOutput's field the model did not fill (hidden_states unless asked for)
        raise ModelOutputError(f"model.output: {what} of the model's output ({_kind(raw)}) is None, the model did not "
                               f"compute it: set model.output to a part it returns (its parts: {_listed(_parts(raw))})")
    if not isinstance(value, Tensor):
        raise ModelOutputError(f"model.output: {what} of the model's output ({_kind(raw)}) is {_kind(value)}, not a "
                               f"tensor: set model.output to the part the loss takes (its parts: {_listed(_parts(raw))})")
    return value


@dataclass(frozen=True, slots=True)
class Objective:
    """What a training step minimises: the model's forward on a batch, the part of its output
    `model.output` names, and the loss on it (or the model's own loss, `output: loss`)."""

    loss_fn: Loss | None  # None: the model computes the loss (output "loss")
    output: str = AUTO

    @property
    def model_loss(self) -> bool:
        return self.output == MODEL_LOSS

    def forward(self, model: Callable, x: Any, y: Any) -> Any:
        """The model's raw output on inputs `x` (the targets go in too when it computes the loss)."""
        return model(x, labels=y) if self.model_loss else model(x)

    def loss(self, raw: Any, y: Any) -> Tensor:
        if not self.model_loss:
            return self.loss_fn(pick(raw, self.output), y)
        value = _part(raw, MODEL_LOSS)
        if not isinstance(value, Tensor):
            raise ModelOutputError(
                f"model.output: loss takes the loss the model computes when called as model(inputs, labels=targets), and its "
                f"output ({_kind(raw)}) has {'none' if value is _MISSING or value is None else _kind(value)} (its parts: "
                f"{_listed(_parts(raw))}): leave model.output out (auto) and give a loss section, or make the model take labels")
        return value

    def predictions(self, raw: Any) -> Tensor | None:
        """What accuracy and the label check read; None when the model computed its own loss
        (its logits need not line up with the targets: a causal LM shifts them itself)."""
        return None if self.model_loss else pick(raw, self.output)

    def __call__(self, model: Callable, x: Any, y: Any) -> Tensor:
        return self.loss(self.forward(model, x, y), y)


def as_objective(loss: Objective | Loss) -> Objective:
    """A plain loss `(outputs, targets) -> scalar` as an Objective over the model's output (auto)."""
    return loss if isinstance(loss, Objective) else Objective(loss)
