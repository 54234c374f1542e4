"""What makes a checkpoint whole: its manifest, and finding the newest whole one.

Plain files and hashes, no torch: `campaign status` and `campaign resize` read checkpoints
through this module and answer in a fraction of a second instead of importing torch
first. training/checkpoint.py writes checkpoints with DCP and uses this to seal them.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from pathlib import Path

from training.files import write_json_atomic

PREFIX = "step-"
TMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path, step: int, world_size: int) -> None:
    files = {
        p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    write_json_atomic(directory / MANIFEST, {"step": step, "world_size": world_size, "created": time.time(), "files": files})


def verify(directory: Path) -> str | None:
    """None if the checkpoint matches its manifest, else what is wrong with it."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        return f"no readable manifest ({e.__class__.__name__})"
    for name, meta in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != meta["bytes"] or _sha256(path) != meta["sha256"]:
            return f"{name} does not match its checksum"
    return None


def checkpoint_step(directory: Path) -> int:
    return int(directory.name[len(PREFIX):])


def list_checkpoints(root: Path) -> list[Path]:
    """Visible checkpoints under root, newest first (not verified)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=checkpoint_step, reverse=True)


def latest_valid_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint that matches its manifest; corrupt ones are reported and skipped."""
    for directory in list_checkpoints(root):
        problem = verify(directory)
        if problem is None:
            return directory
        warnings.warn(f"skipping checkpoint {directory}: {problem}", stacklevel=2)
    return None
