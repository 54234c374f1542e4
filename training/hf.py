"""Hugging Face `transformers` models built from a config, with random weights and no download:

    model:
      target: training.hf:from_config
      kwargs: {model: GPT2LMHeadModel, config: {vocab_size: 256, n_positions: 64, n_layer: 2, n_embd: 64, n_head: 2}}

Why a helper here and not a builder in each example: a transformers class is built as
`cls(cls.config_class(**config))`, which `target` and `kwargs` alone cannot say, so every
user would write the same five lines, each with the same trap: a config key transformers
does not know (`n_layers` for `n_layer`) is kept as a stray attribute and the model is
built at its default size without a word. Here the class is named as `transformers` exports
it, the config by its keys (a grid varies them: `model.kwargs.config.n_layer: [2, 4]`), and
a key the config does not know is refused before anything runs, naming the field.

`transformers` is the optional extra `pip install -e '.[transformers]'`, imported only when
a model is built. The model returns a `ModelOutput`; the loss takes its `logits` (model.output:
auto), or, with `model.output: loss`, the loss the model computes from `labels` (training.outputs).
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from torch import nn

from training.errors import CampaignError


class HfModelError(CampaignError):
    """A transformers model that cannot be built from model.kwargs; the message names the key."""


def from_config(model: str, config: dict[str, Any] | None = None) -> nn.Module:
    """`transformers.<model>` built from its config class with `config`'s keys, randomly
    initialised (the trial's seed decides the weights). An Auto class (`AutoModelForCausalLM`)
    takes the architecture from `config`'s `model_type` (e.g. gpt2)."""
    try:
        import transformers
    except ImportError:
        raise HfModelError("model.target: training.hf:from_config builds a Hugging Face transformers model, and transformers "
                           "is not installed: pip install -e '.[transformers]'") from None
    config = dict(config or {})
    cls = getattr(transformers, model, None) if model.isidentifier() else None
    if not inspect.isclass(cls) or not (issubclass(cls, nn.Module) or hasattr(cls, "from_config")):
        close = difflib.get_close_matches(model, [n for n in dir(transformers) if n[:1].isupper()], n=3)
        raise HfModelError(f"model.kwargs.model: transformers has no model class {model!r}"
                           + (f" (did you mean {', '.join(close)}?)" if close else "")
                           + ": name one as transformers exports it, e.g. GPT2LMHeadModel or AutoModelForCausalLM")
    if issubclass(cls, nn.Module):
        config_class = cls.config_class
    else:  # an Auto class: the config's model_type picks the architecture
        model_type = config.pop("model_type", None)
        if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
            raise HfModelError(f"model.kwargs.config.model_type: {model} builds the architecture a model_type names "
                               f"(gpt2, llama, bert, ...), got {model_type!r}: set model.kwargs.config.model_type")
        config_class = transformers.CONFIG_MAPPING[model_type]
    _refuse_unknown(config, config_class)
    given = dict(config)
    # The trainer never reads a generation cache; building one each step only holds memory.
    config.setdefault("use_cache", False)
    try:
        made = config_class(**config)
        return cls(made) if issubclass(cls, nn.Module) else cls.from_config(made)
    except CampaignError:
        raise
    except Exception as e:
        raise HfModelError(f"model.kwargs.config: {model} from {config_class.__name__}({given}) raised {type(e).__name__}: {e}") from None


def _refuse_unknown(config: dict[str, Any], config_class: type) -> None:
    try:
        defaults = config_class()
    except Exception:  # a config that has no defaults (a composite one): transformers checks its own keys
        return
    known = set(defaults.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    for klass in config_class.__mro__:
        if "__init__" in vars(klass):
            known |= set(inspect.signature(klass.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(k for k in config if k not in known and not hasattr(defaults, k))
    if unknown:
        hints = "; ".join(f"{k}: did you mean {close[0]}?" for k in unknown
                          if (close := difflib.get_close_matches(k, sorted(known), n=1)))
        raise HfModelError(f"model.kwargs.config: {config_class.__name__} has no {', '.join(unknown)}"
                           + (f" ({hints})" if hints else "")
                           + "; transformers would keep such a key unused and build the model at its default size: "
                           "use the config's own names")
