"""Dependencies run one way, top to bottom: flows → tasks → cluster → training.

A module may import its own layer and those below it, never one above: the trainer runs
under plain torchrun without the cluster code, the policy is simulated without Prefect,
and the spec (training/spec.py, a pure data model) is readable from every layer. The
contract lives in pyproject.toml ([tool.importlinter]) and import-linter checks it: every
import counts, function-level ones too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_no_layer_imports_one_above_it():
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 kept, 0 broken" in done.stdout


def test_the_contract_catches_an_upward_import(tmp_path):
    """The same contract on a tree where training/ imports flows, inside a function: broken,
    naming the module and the import."""
    for layer in ("flows", "tasks", "cluster", "training"):
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "__init__.py").write_text("")
    (tmp_path / "flows" / "cli.py").write_text("def main():\n    pass\n")
    (tmp_path / "training" / "bad.py").write_text("def f():\n    from flows.cli import main\n    return main\n")
    text = (REPO / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(text[text.index("[tool.importlinter]"):])
    done = lint_imports(tmp_path)
    assert done.returncode != 0 and "BROKEN" in done.stdout, done.stdout[-3000:]
    assert "training.bad -> flows.cli" in done.stdout, done.stdout[-3000:]
