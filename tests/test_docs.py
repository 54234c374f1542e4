"""The generated references of the documentation site cannot go stale silently: the spec
reference names every field of the spec's models and says what each means, and the CLI
reference names every command of the typer app, and the site's hook adds both as pages.
(`make test` also builds the whole site with `mkdocs build --strict`, where a broken link or
missing page fails.)"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import typer
from pydantic import BaseModel

from flows.cli import app
from flows.cli_docs import cli_reference
from training.spec import CampaignSpec
from training.spec_docs import NOTES, sections, spec_reference

REPO = Path(__file__).resolve().parent.parent


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def field_paths(model: type[BaseModel] = CampaignSpec, prefix: str = "") -> set[str]:
    """Every field's dotted path, walked here apart from the generator: a list of models adds
    `[]`, a map of them `.<key>` (cluster.nodes[].name, search.space.<key>.choice)."""
    paths = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        paths.add(path)
        annotation = field.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # Optional[list[...]]
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        origin = typing.get_origin(annotation)
        suffix = "[]" if origin is list else ".<key>" if origin is dict else ""
        for sub in _models(field.annotation):
            paths |= field_paths(sub, path + suffix)
    return paths


def test_the_spec_reference_names_every_field():
    page = spec_reference()
    paths = field_paths()
    assert len(paths) > 80  # the walk reached the nested models
    missing = sorted(p for p in paths if f"| `{p}` |" not in page)
    assert not missing, f"the spec reference lacks {missing}: training/spec_docs.py must walk every model"


def test_every_field_of_the_spec_reference_says_what_it_means():
    rows = [row for section in sections() for row in section.rows]
    undescribed = sorted(r.note_key for r in rows if not r.description.strip())
    assert not undescribed, (f"{undescribed} have no description: give the field one in training/spec.py "
                             "(Field(description=...)) or a line in training/spec_docs.py's NOTES")
    keys = {r.note_key for r in rows}
    stale = sorted(set(NOTES) - keys)
    assert not stale, f"NOTES in training/spec_docs.py names {stale}, which are no field of the spec any more"
    twice = sorted(r.note_key for section in sections() for r in section.rows
                   if r.note_key in NOTES and section.model.model_fields[r.path.rsplit(".", 1)[-1]].description)
    assert not twice, f"{twice} now have a description in training/spec.py: remove their NOTES in training/spec_docs.py"


def test_the_spec_reference_shows_bounds_defaults_and_the_default_campaign(monkeypatch):
    monkeypatch.chdir(REPO)  # the example is params.yaml, as the site's build runs at the root
    page = spec_reference()
    assert "| `training.lr` | float in (0, 10] | `required` |" in page
    assert "| `resources.devices` | int in [1, 4096] \\| [int in [1, 4096], int in [1, 4096]] \\| \"auto\" | `1` |" in page
    assert "| `optimizer.name` |" in page and '`"SGD"`' in page
    assert (REPO / "params.yaml").read_text(encoding="utf-8").strip() in page
    anchors = set(re.findall(r"\{#([a-z0-9_-]+)\}", page))
    linked = set(re.findall(r"\]\(#([a-z0-9_-]+)\)", page))
    assert linked and linked <= anchors, f"links to no section: {sorted(linked - anchors)}"


def _commands(command, words=("campaign",)):
    if hasattr(command, "list_commands"):
        ctx = command.context_class(command)
        for name in command.list_commands(ctx):
            yield from _commands(command.get_command(ctx, name), (*words, name))
    else:
        yield " ".join(words)


def test_the_cli_reference_names_every_command():
    page = cli_reference()
    commands = list(_commands(typer.main.get_command(app)))
    assert {"campaign launch", "campaign status", "campaign pool init"} <= set(commands)
    missing = [c for c in commands if not re.search(rf"^#+ `{re.escape(c)}`$", page, re.M)]
    assert not missing, f"the CLI reference lacks {missing}"
    assert "--rerun" in page and "--watch" in page  # options, with their help


def test_the_sites_hook_adds_both_references_as_pages(monkeypatch):
    """What `mkdocs build` runs: the hook in mkdocs.yml adds the two pages the nav names, from the generators."""
    from mkdocs.config import load_config
    from mkdocs.structure.files import Files

    monkeypatch.chdir(REPO)  # the spec reference's example is params.yaml, as the build runs at the root
    config = load_config(str(REPO / "mkdocs.yml"))
    files = config.plugins.on_files(Files([]), config=config)
    assert files.get_file_from_path("reference/spec.md").content_string == spec_reference()
    assert files.get_file_from_path("reference/cli.md").content_string == cli_reference()
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    assert "reference/spec.md" in nav and "reference/cli.md" in nav
