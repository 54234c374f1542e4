"""The JSON Schema of a campaign spec (`params.yaml`), generated from training/spec.py's models.

Editors read it through the first line of every spec, `# yaml-language-server: $schema=<path>`
(VS Code's YAML extension, any yaml-language-server client): fields complete, unknown ones
and wrong types are underlined as you type. It checks each field's shape, type and range only;
the checks across fields (a grid value in its field, warmup below steps, ...) are the loader's
(`training.spec.load_spec`), which stays the authority.

Regenerate after changing a model (tests/test_spec_schema.py fails until then):

    make schema        # or: python -m training.spec_schema --write

The file lives at schema/params.schema.json, a folder of its own rather than docs/: it is a
generated, machine-read file that editors and the tests open by path, not prose, and its own
folder keeps that path short and stable (`schema/...` from params.yaml, `../schema/...` from
examples/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from training.spec import CampaignSpec

SCHEMA_PATH = Path("schema/params.schema.json")  # relative to the repository root
REGENERATE = "make schema (or: python -m training.spec_schema --write)"
DRAFT = "https://json-schema.org/draft/2020-12/schema"  # the draft pydantic v2 generates ($defs, $ref with siblings)
TITLE = "Campaign spec (params.yaml)"


def spec_schema() -> dict[str, Any]:
    """The JSON Schema of CampaignSpec, as validated (inputs, not dumps), with `$schema` and a title; no `$id`
    (editors resolve it by its path, and an `$id` would pin it to one URL)."""
    body = CampaignSpec.model_json_schema(mode="validation")
    body.pop("title", None)
    body.pop("$id", None)
    return {"$schema": DRAFT, "title": TITLE, **body}


def schema_text() -> str:
    """The schema file's text: stable key order (the models'), two-space indents, a final newline."""
    return json.dumps(spec_schema(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.spec_schema",
                                     description="Print (or --write) the JSON Schema of params.yaml.")
    parser.add_argument("--write", nargs="?", const=str(SCHEMA_PATH), default=None, metavar="PATH",
                        help=f"write it to PATH (default {SCHEMA_PATH}) instead of printing it")
    args = parser.parse_args(argv)
    text = schema_text()
    if args.write is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.write)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
