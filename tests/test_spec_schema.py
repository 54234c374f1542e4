"""The JSON Schema of params.yaml (training/spec_schema.py): committed, current, and true of the repo's specs."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema  # a dependency of prefect (pinned in pyproject.toml): always installed with the project
import pytest
import yaml

from training.spec import SpecError, load_spec, parse_spec
from training.spec_schema import REGENERATE, SCHEMA_PATH, main, schema_text, spec_schema

REPO = Path(__file__).resolve().parent.parent
SPECS = [REPO / "params.yaml", *sorted((REPO / "examples").glob("**/*.yaml"))]
SCHEMA_LINE = re.compile(r"# yaml-language-server: \$schema=(\S+)\n")


def validator() -> jsonschema.Draft202012Validator:
    schema = spec_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_committed_schema_is_current():
    committed = (REPO / SCHEMA_PATH).read_text(encoding="utf-8")
    assert committed == schema_text(), (f"{SCHEMA_PATH} is not what training/spec.py's models generate now: "
                                        f"regenerate it with `{REGENERATE}` and commit it")


def test_module_prints_and_writes_the_schema(tmp_path, capsys):
    assert main([]) == 0
    assert capsys.readouterr().out == schema_text()
    assert main(["--write", str(tmp_path / "out" / "s.json")]) == 0
    assert (tmp_path / "out" / "s.json").read_text(encoding="utf-8") == schema_text()
    schema = spec_schema()
    assert schema["$schema"].startswith("https://json-schema.org/") and schema["title"] and "$id" not in schema


def test_examples_are_found():
    assert len(SPECS) > 3 and all(p.suffix == ".yaml" for p in SPECS)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: str(p.relative_to(REPO)))
def test_repo_specs_validate_against_schema(path):
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator().iter_errors(raw)]
    assert not errors, f"{path.name} fails the schema:\n" + "\n".join(errors)
    load_spec(path)  # the schema comment line is a YAML comment: the loader reads the file as before


@pytest.mark.parametrize("path", SPECS, ids=lambda p: str(p.relative_to(REPO)))
def test_specs_carry_the_schema_line(path):
    first = path.read_text(encoding="utf-8").split("\n", 1)[0] + "\n"
    match = SCHEMA_LINE.fullmatch(first)
    assert match, f"{path.name} must start with `# yaml-language-server: $schema=<relative path to {SCHEMA_PATH}>`"
    target = (path.parent / match.group(1)).resolve()
    assert target == (REPO / SCHEMA_PATH).resolve() and target.is_file()


@pytest.mark.parametrize("change, where", [
    (lambda raw: raw["training"].update(stepz=10), "training"),            # a misspelt field
    (lambda raw: raw.update(extra_section={}), ""),                          # an unknown section
    (lambda raw: raw["training"].update(steps="many"), "training.steps"),   # a wrong type
    (lambda raw: raw["training"].update(steps=0), "training.steps"),        # out of range
    (lambda raw: raw["resources"].update(devices="some"), "resources.devices"),  # none of N, [min, max], auto
    (lambda raw: raw["grid"].update({"training.lr": 0.1}), "grid.training.lr"),  # an axis is a list
])
def test_schema_refuses_unknown_fields_and_wrong_types(change, where):
    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    raw.setdefault("resources", {})
    assert not list(validator().iter_errors(raw))
    bad = copy.deepcopy(raw)
    change(bad)
    errors = list(validator().iter_errors(bad))
    assert errors and any(".".join(map(str, e.absolute_path)) == where for e in errors), [e.message for e in errors]
    with pytest.raises(SpecError):  # the loader refuses it too: the schema is no looser here
        parse_spec(bad)


def test_schema_accepts_the_several_shapes_of_a_field():
    raw = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    for devices, memory in ((2, 1.5), ([1, 2], "auto"), ("auto", None)):
        spec = {**raw, "resources": {"devices": devices, "memory_gb": memory}}
        assert not list(validator().iter_errors(spec)), (devices, memory)
    for stall in (60, "auto", None):
        assert not list(validator().iter_errors({**raw, "training": {**raw["training"], "stall_timeout_s": stall}}))
