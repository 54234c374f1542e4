"""The spec reference (docs/reference/spec.md), generated from training/spec.py's models.

Every field of CampaignSpec, section by section: its dotted path, its type with its bounds
(from pydantic's JSON Schema of the field, the same one schema/params.schema.json holds), its
default and what it means (the field's `description`, else a line of NOTES below). The site's
build calls `spec_reference()` (docs/hooks.py), so the page cannot lag behind the models;
tests/test_docs.py checks that it names every field and that every field says what it means.

Checks across fields (a grid value in its field, warmup below steps, ...) are the loader's;
docs/guides/spec.md describes them.

    python -m training.spec_docs      # print the page
"""

from __future__ import annotations

import json
import re
import sys
import typing
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from training.spec import CampaignSpec

# What a field means where its model gives no `description` (keyed by the path this page
# prints). A description added to the model wins; tests/test_docs.py then asks for the note's removal.
NOTES: dict[str, str] = {
    "campaign": "the campaign's name and seed",
    "campaign.name": "the campaign's identity: its records, checkpoints, MLflow runs and summary are found again by it "
                     "(a folder name under tracking.runs_dir)",
    "data": "the training and validation data",
    "model": "the model: a built-in (`name`) or your own (`target`); required unless training.target names your own loop",
    "model.name (small_cnn)": "two 3x3 conv blocks and a linear head, for 8x8 images (sklearn's digits)",
    "model.width (small_cnn)": "channels of the first conv block (the second has twice as many)",
    "model.dropout (small_cnn)": "dropout probability",
    "model.name (mlp)": "a multi-layer perceptron over flattened images",
    "model.width (mlp)": "units of each hidden layer",
    "model.depth (mlp)": "hidden layers",
    "model.dropout (mlp)": "dropout probability after each hidden layer",
    "model.kwargs": "keyword arguments of model.target",
    "optimizer": "the optimizer",
    "optimizer.kwargs": "keyword arguments of the optimizer class (every number finite; momentum in [0, 1), dampening, "
                        "weight_decay and rho in [0, 1], betas each in [0, 1), eps in (0, 1])",
    "loss": "the training loss",
    "loss.name": "a built-in loss: cross_entropy ((N, ..., C) outputs, so sequence models too; the default) or mse",
    "loss.kwargs": "keyword arguments of loss.target",
    "training": "the training recipe, the project's loop or your own function",
    "training.steps": "optimizer steps of each trial (goodput: the trial ends after steps x batch_size samples)",
    "training.lr": "the peak learning rate (goodput: at batch_size, scaled with the batch)",
    "training.schedule": "after the warm-up: cosine decay to 0 at the last step, or constant",
    "training.warmup_steps": "steps of linear warm-up from 0 (fewer than steps)",
    "training.checkpoint_every": "steps between checkpoints: a kill loses at most that many (each holds the training "
                                 "thread ~10-20 ms; the write runs in the background)",
    "training.log_every": "steps between logged metrics (the loss is read back from the device only then)",
    "training.eval_every": "steps between evaluations on the validation set (early stopping judges at these)",
    "grid": "`section.field: [values]` over model, data, training, optimizer and loss, deeper into kwargs "
            "(`model.kwargs.depth`); the trials are the cartesian product",
    "search": "trials drawn from a space by an Optuna sampler instead of a grid",
    "search.strategy": "the sampler: random, sobol (quasi-random), tpe (learns from the results told so far), "
                       "grid (every combination of `choice` dimensions)",
    "search.space.<key>.choice": "values to pick from",
    "search.space.<key>.uniform": "[low, high]: a float drawn uniformly",
    "search.space.<key>.log_uniform": "[low, high], both > 0: a float drawn uniformly in log space",
    "search.space.<key>.int_uniform": "[low, high]: an integer drawn uniformly",
    "early_stopping": "stop bad trials at an evaluation; their devices go to the others",
    "early_stopping.rule": "Optuna's pruner: asha (asynchronous successive halving), hyperband, or median (stop a trial "
                           "below the median of the others at the same step)",
    "resources": "what each trial asks for",
    "cluster": "where trials run: this host's devices, a declared cluster for `campaign plan`, or a pool",
    "cluster.nodes[].name": "the node's name",
    "cluster.nodes[].devices": "devices on the node",
    "cluster.nodes[].memory_gb": "GiB of memory per device",
    "cluster.nodes[].kind": "gpu or cpu",
    "cluster.nodes[].model": "the device model, as a label",
    "cluster.nodes[].nvlink_pairs": "pairs of device indexes joined by NVLink",
    "scheduling": "how elastic trials are sized and resized while they run",
    "tracking": "where results go: MLflow, the runs folder, the DVC summary and remote",
    "tracking.experiment": "the MLflow experiment",
    "tracking.runs_dir": "the folder of the campaigns' records and checkpoints (its `latest` names the last campaign launched)",
    "tracking.keep_checkpoints": "checkpoints kept per trial; older ones are deleted once a newer one is whole",
}


class Row(typing.NamedTuple):
    path: str       # as printed: training.steps, cluster.nodes[].name, search.space.<key>.choice
    note_key: str   # the key of NOTES: the path, with the variant for a field of a built-in model
    type: str
    default: str
    description: str


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through Optional, Union, list, dict, Annotated), in order."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += [m for m in _models_in(arg) if m not in found]
    return found


def _container(annotation: Any) -> str:
    """'[]' for a list of models, '.<key>' for a dict of them, '' otherwise (Optional unwrapped)."""
    origin = typing.get_origin(annotation)
    if origin is list:
        return "[]"
    if origin is dict:
        return ".<key>"
    for arg in typing.get_args(annotation):
        if arg is not type(None) and (inner := _container(arg)):
            return inner
    return ""


def _variant(model: type[BaseModel]) -> str | None:
    """A built-in model's name (small_cnn, mlp): its fields share paths with the other built-in's."""
    name = model.model_fields.get("name")
    args = typing.get_args(name.annotation) if name is not None else ()
    return args[0] if name is not None and typing.get_origin(name.annotation) is typing.Literal and len(args) == 1 else None


def _bounds(schema: dict[str, Any]) -> str:
    low = ("[", schema["minimum"]) if "minimum" in schema else ("(", schema["exclusiveMinimum"]) if "exclusiveMinimum" in schema else None
    high = (schema["maximum"], "]") if "maximum" in schema else (schema["exclusiveMaximum"], ")") if "exclusiveMaximum" in schema else None
    num = lambda v: f"{v:,}".replace(",", " ") if isinstance(v, int) and abs(v) >= 10_000 else f"{v:g}"
    if low and high:
        return f" in {low[0]}{num(low[1])}, {num(high[0])}{high[1]}"
    if low:
        return f" {'≥' if low[0] == '[' else '>'} {num(low[1])}"
    if high:
        return f" {'≤' if high[1] == ']' else '<'} {num(high[0])}"
    return ""


def _type(schema: dict[str, Any], links: dict[str, str]) -> str:
    """A field's JSON Schema as a short type with its bounds: `int in [1, 4096] | [int, int] | "auto"`;
    a nested model as a link to its own table (`links`: the model's name to it)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return links.get(name, name)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(dict.fromkeys(_type(s, links) for s in schema[key]))
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        sizes = ""
        if "maxItems" in schema and schema.get("minItems") != schema["maxItems"]:
            sizes = f" (at most {schema['maxItems']})"
        elif schema.get("minItems") and "prefixItems" not in schema:
            sizes = f" (at least {schema['minItems']})"
        if "prefixItems" in schema:
            return "[" + ", ".join(_type(s, links) for s in schema["prefixItems"]) + "]"
        item = schema.get("items") or {}
        return f"list of {_type(item, links) if item else 'any'}{sizes}"
    if kind == "object":
        values = schema.get("additionalProperties")
        sizes = f" (at least {schema['minProperties']})" if schema.get("minProperties") else ""
        return (f"map of name to {_type(values, links)}" if isinstance(values, dict) and values else "map of name to any") + sizes
    names = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "null"}
    text = names.get(kind, "any") + _bounds(schema)
    if kind == "string":
        if "pattern" in schema:
            text += f" matching `{schema['pattern']}`"
        if "minLength" in schema and schema["minLength"] > 0:
            text += " (not empty)" if schema["minLength"] == 1 else f" (at least {schema['minLength']} characters)"
        if "maxLength" in schema:
            text += f" (at most {schema['maxLength']} characters)"
    return text


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "its fields' defaults"
    if isinstance(value, Path):
        value = str(value)
    return json.dumps(value, default=str)


class Section(typing.NamedTuple):
    model: type[BaseModel]
    path: str       # "" for the top level
    title: str
    anchor: str
    rows: list[Row]


def _walk(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[type[BaseModel], str]]:
    """(model, the path of its section), depth first: the top level, then each field's models."""
    yield model, prefix
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        for sub in _models_in(field.annotation):
            yield from _walk(sub, path + _container(field.annotation))


def _title(model: type[BaseModel], path: str) -> str:
    if path == "model":
        return f"model: {_variant(model) or 'target'}"
    if path.startswith("search.space"):
        return f"search.space: {next(iter(model.model_fields))}"
    return path or "Sections"


def _rows(model: type[BaseModel], prefix: str, links: dict[str, str]) -> list[Row]:
    properties = model.model_json_schema(mode="validation")["properties"]
    variant = _variant(model)
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        note_key = f"{path} ({variant})" if variant and prefix == "model" else path
        out.append(Row(path, note_key, _type(properties[name], links), _default(field),
                       field.description or NOTES.get(note_key, "")))
    return out


def sections(spec: type[BaseModel] = CampaignSpec) -> list[Section]:
    """Every table of the page: the top level's, then one per model a field holds."""
    walked = list(_walk(spec))
    titles = {m: _title(m, path) for m, path in walked}
    anchors = {m: re.sub(r"[^a-z0-9_]+", "-", titles[m].lower()).strip("-") for m, _ in walked}
    links = {m.__name__: f"[{titles[m]}](#{anchors[m]})" for m, path in walked if path}
    return [Section(m, path, titles[m], anchors[m], _rows(m, path, links)) for m, path in walked]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _doc(model: type[BaseModel]) -> str:
    """The model's own docstring's first paragraph, if it has one (not pydantic's BaseModel's)."""
    doc = model.__dict__.get("__doc__") or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def spec_reference(example: Path | None = Path("params.yaml")) -> str:
    """The page's Markdown: every section's fields in a table, then the default campaign's spec as an example."""
    out = [
        "# Spec reference",
        "",
        "Every field of a campaign spec (`params.yaml`), generated from the pydantic models in "
        "`training/spec.py` when this site is built. A type shows its bounds: `[a, b]` includes an end, "
        "`(a, b)` excludes it. The loader also checks values across fields (a grid value in the field it "
        "reaches, `warmup_steps` below `steps`, ...): see [Writing a spec](../guides/spec.md). Editors "
        "complete and check these fields through `schema/params.schema.json`.",
        "",
    ]
    for section in sections():
        out += [f"## {section.title} {{#{section.anchor}}}", ""]
        if doc := _doc(section.model) if section.path else "":
            out += [doc, ""]
        out += ["| field | type | default | what |", "| --- | --- | --- | --- |"]
        out += [f"| `{r.path}` | {_cell(r.type)} | `{_cell(r.default)}` | {_cell(r.description)} |" for r in section.rows]
        out.append("")
    if example is not None and example.is_file():
        out += ["## Example: the default campaign", "", f"`{example}`, what `make campaign` runs:", "", "```yaml",
                example.read_text(encoding="utf-8").rstrip("\n"), "```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(spec_reference())
