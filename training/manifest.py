"""What makes a checkpoint whole and ours: its manifest, and finding the newest such one.

Plain files and hashes, no torch: `campaign status` and `campaign resize` read checkpoints
through this module and answer in a fraction of a second instead of importing torch
first. training/checkpoint.py writes checkpoints with DCP and uses this to seal them.

The manifest lists every file with its size and sha256, and is itself signed with an
HMAC under this host's checkpoint key (created once, readable by its owner only). DCP
unpickles a checkpoint's `.metadata`, so a checkpoint is loaded only when the signature
holds: someone who can write the folder (or a poisoned DVC remote) but not read the key
cannot make a checkpoint that loads. A file the manifest does not list, a manifest of the
wrong shape or a missing signature makes the checkpoint invalid, never loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

from training.files import InputError, loads_json, read_bounded, write_json_atomic

MAX_MANIFEST_BYTES = 1 << 20  # a few DCP files' names and hashes

PREFIX = "step-"
TMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"
KEY_ENV = "CAMPAIGN_CHECKPOINT_KEY"  # path of the signing key; default ~/.local/state/campaign/checkpoint.key
SHA256 = re.compile(r"^[0-9a-f]{64}$")
FILE_NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*$")


def key_path() -> Path:
    return Path(os.environ.get(KEY_ENV) or Path.home() / ".local" / "state" / "campaign" / "checkpoint.key")


def signing_key() -> bytes:
    """This host's checkpoint key, made on first use (0600; the first of racing processes wins)."""
    path = key_path()
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_whole(path)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32).hex().encode())
        f.flush()
        os.fsync(f.fileno())
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    return read_bounded(path, 4096, fix=f"the checkpoint key is a regular file (set ${KEY_ENV} to another path)")


def _read_whole(path: Path) -> bytes:
    for _ in range(100):  # another process created it a moment ago and is writing it
        data = _read_key(path)
        if len(data) == 64:
            return data
        time.sleep(0.01)
    return _read_key(path)


def _signature(body: dict[str, Any]) -> str:
    canonical = json.dumps({k: body[k] for k in ("step", "files")}, sort_keys=True).encode()
    return hmac.new(signing_key(), canonical, hashlib.sha256).hexdigest()


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path, step: int, world_size: int, grant: dict[str, Any] | None = None) -> None:
    files = {
        p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    body = {"step": step, "world_size": world_size, "created": time.time(), "files": files}
    if grant is not None:  # the lease grant it was written under (training.fence.grant_of)
        body["grant"] = grant
    write_json_atomic(directory / MANIFEST, {**body, "hmac": _signature(body)})


def verify(directory: Path) -> str | None:
    """None if the checkpoint is whole and signed by this host's key, else what is wrong with it."""
    try:
        manifest = loads_json(read_bounded(directory / MANIFEST, MAX_MANIFEST_BYTES), directory / MANIFEST)
    except (OSError, InputError) as e:
        return f"no readable manifest ({e.__class__.__name__}: {e})"
    problem = _shape_problem(manifest)
    if problem:
        return f"the manifest is malformed: {problem}"
    if not hmac.compare_digest(str(manifest.get("hmac", "")), _signature(manifest)):
        return f"the manifest's signature does not match this host's checkpoint key ({key_path()})"
    listed = manifest["files"]
    present = {p.name for p in directory.iterdir() if p.name != MANIFEST}
    if unlisted := sorted(present - set(listed)):
        return f"{unlisted[0]} is not in the manifest"
    for name, meta in listed.items():
        path = directory / name
        if not path.is_file() or path.is_symlink():
            return f"{name} is missing"
        if path.stat().st_size != meta["bytes"] or _sha256(path) != meta["sha256"]:
            return f"{name} does not match its checksum"
    return None


def _shape_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict):
        return "not a mapping"
    if not isinstance(manifest.get("step"), int):
        return "no integer step"
    grant = manifest.get("grant")
    if grant is not None and not (isinstance(grant, dict) and isinstance(grant.get("lease_file"), str)
                                  and isinstance(grant.get("epoch"), int)):
        return "the grant is not a lease file and an integer epoch"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "no files listed"
    for name, meta in files.items():
        if not (isinstance(name, str) and FILE_NAME.match(name) and name not in (".", "..")):
            return f"file name {name!r}"
        if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and isinstance(meta.get("sha256"), str)
                and SHA256.match(meta["sha256"])):
            return f"entry of {name!r}"
    return None


def checkpoint_step(directory: Path) -> int:
    return int(directory.name[len(PREFIX):])


def list_checkpoints(root: Path) -> list[Path]:
    """Visible checkpoints under root, newest first (not verified)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=checkpoint_step, reverse=True)


def checkpoint_report(root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that matches its manifest, and the newer ones refused (with why).

    A checkpoint written under an older grant of a lease file than an earlier step's is
    refused too: a fenced holder's late write (its campaign stalled, the trial was granted
    again and went on) is not trusted as newer than what the new grant wrote."""
    refused = []
    found = list_checkpoints(root)
    for i, directory in enumerate(found):
        problem = verify(directory) or _superseded(directory, found[i + 1:])
        if problem is None:
            return directory, refused
        refused.append((directory, problem))
    return None, refused


def _superseded(directory: Path, older: list[Path]) -> str | None:
    grant = _signed_grant(directory)
    if grant is None:
        return None
    for other in older:
        earlier = _signed_grant(other)
        if earlier and earlier["lease_file"] == grant["lease_file"] and earlier["epoch"] > grant["epoch"]:
            return (f"written under lease epoch {grant['epoch']} after {other.name} was written under epoch "
                    f"{earlier['epoch']}: a late write by a holder that had lost its lease")
    return None


def _signed_grant(directory: Path) -> dict[str, Any] | None:
    """The grant in a checkpoint's manifest when the manifest is ours (signature only: the
    files are not hashed for this), else None."""
    try:
        manifest = loads_json(read_bounded(directory / MANIFEST, MAX_MANIFEST_BYTES), directory / MANIFEST)
    except (OSError, InputError):
        return None
    if _shape_problem(manifest) or not hmac.compare_digest(str(manifest.get("hmac", "")), _signature(manifest)):
        return None
    return manifest.get("grant")


def latest_valid_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint that matches its manifest; corrupt ones are reported and skipped."""
    latest, refused = checkpoint_report(root)
    for directory, problem in refused:
        warnings.warn(f"skipping checkpoint {directory}: {problem}", stacklevel=2)
    return latest
