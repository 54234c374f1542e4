"""MkDocs hooks (mkdocs.yml `hooks:`): the two reference pages generated from the code at build time.

reference/spec.md comes from training/spec.py's pydantic models (training/spec_docs.py), and
reference/cli.md from the typer app in flows/cli.py (flows/cli_docs.py). Neither is a file in
the repository, so neither can go stale; tests/test_docs.py checks what they name.
"""

from __future__ import annotations

from mkdocs.structure.files import File, Files

from flows.cli_docs import cli_reference
from training.spec_docs import spec_reference

GENERATED = {"reference/spec.md": spec_reference, "reference/cli.md": cli_reference}


def on_files(files: Files, config) -> Files:
    for path, generate in GENERATED.items():
        files.append(File.generated(config, path, content=generate()))
    return files
