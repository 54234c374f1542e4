"""Dependencies run one way, top to bottom: flows → tasks → cluster → training.

A module may import its own layer and those below it, never one above: the trainer runs
under plain torchrun without the cluster code, the policy is simulated without Prefect,
and the spec (training/spec.py, a pure data model) is readable from every layer. The
check reads every module's imports (function-level ones too), so it fails on the change
that adds an upward import, naming the file, the line and the import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYERS = ("training", "cluster", "tasks", "flows")  # bottom to top


def imported_packages(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def upward_imports() -> list[str]:
    found = []
    for rank, layer in enumerate(LAYERS):
        for path in sorted((REPO / layer).rglob("*.py")):
            for line, package in imported_packages(path):
                if package in LAYERS and LAYERS.index(package) > rank:
                    found.append(f"{path.relative_to(REPO)}:{line} imports {package} (layer {layer} is below {package})")
    return found


def test_no_layer_imports_one_above_it():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a module of training/ that imports flows is reported."""
    fake = tmp_path / "training"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from flows.cli import main\n")
    for layer in LAYERS[1:]:
        (tmp_path / layer).mkdir()
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert upward_imports() == ["training/bad.py:2 imports flows (layer training is below flows)"]
