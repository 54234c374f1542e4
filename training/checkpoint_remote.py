"""Checkpoints that travel without shared storage: a DVC remote (`tracking.dvc_remote`).

Once a checkpoint is whole and in view, rank 0 pushes it to the remote with DVC's own data
layer (dvc-data, what `dvc push` runs): its files are content-addressed under `files/md5/`
as DVC lays a remote out, so a file the remote holds already is not sent again (DCP writes
one file per rank, and a step's files differ from the last step's: each save sends its
bytes), and any remote DVC reaches (a directory, s3://, ssh://, ... with its plugin) works. A small index entry,
`index/<campaign>/<trial>/step-XXXXXXXX.json`, names the checkpoint's tree.

A process resuming a trial whose newest checkpoint is not in its own folder (another node,
a fresh machine) pulls the newest indexed one into the folder first. Nothing is trusted for
having come from the remote: the pulled checkpoint's manifest and signature verify it like
any other (nodes that resume each other's trials share the checkpoint key), so a corrupt or
foreign checkpoint is skipped, never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from training.files import fsync_dir
from training.manifest import TMP_PREFIX, checkpoint_step, step_dir_name, verify

OBJECTS = ("files", "md5")  # DVC 3's remote layout
INDEX = "index"
MAX_ENTRY_BYTES = 4096


class RemoteError(OSError):
    """The remote cannot be reached or written; the message names it."""


class CheckpointRemote:
    """One trial's checkpoints on a DVC remote: push after a save, pull before a resume."""

    def __init__(self, url: str, key: str, keep: int = 2):
        from dvc.fs import get_cloud_fs

        try:
            cls, config, root = get_cloud_fs(None, url=url)
            self.fs = cls(**config)
        except Exception as e:  # a scheme without its plugin, a malformed URL
            raise RemoteError(f"{url}: {e}") from None
        self.url, self.root, self.key, self.keep = url, root, key, max(1, keep)

    @property
    def _odb(self):
        from dvc_data.hashfile.db import HashFileDB

        return HashFileDB(self.fs, self.fs.join(self.root, *OBJECTS))

    def _index_dir(self) -> str:
        return self.fs.join(self.root, INDEX, *self.key.split("/"))

    def push(self, checkpoint: Path) -> str:
        """Send a checkpoint's files (those the remote lacks) and index it; its tree's hash."""
        from dvc_data.hashfile.build import build
        from dvc_data.hashfile.transfer import transfer
        from dvc_objects.fs.local import LocalFileSystem

        odb = self._odb
        staging, _, tree = build(odb, str(checkpoint), LocalFileSystem(), "md5")  # staged by reference: each file read once, sent once
        result = transfer(staging, odb, {tree.hash_info}, shallow=False)
        if result.failed:
            raise RemoteError(f"{self.url}: {len(result.failed)} object(s) of {checkpoint.name} were not sent")
        step = checkpoint_step(checkpoint)
        entry = {"step": step, "tree": tree.hash_info.value, "pushed_at": time.time()}
        index = self._index_dir()
        self.fs.makedirs(index, exist_ok=True)
        # Written under a temporary name and moved: a reader never sees half an entry.
        name = f"{step_dir_name(step)}.json"
        partial = self.fs.join(index, f"{TMP_PREFIX}{os.getpid()}-{name}")
        self.fs.pipe_file(partial, json.dumps(entry).encode())
        self.fs.mv(partial, self.fs.join(index, name))
        for old in self.entries()[self.keep:]:  # the index keeps what the trial folder keeps; objects stay (shared, deduplicated)
            self.fs.rm(self.fs.join(index, f"{step_dir_name(old['step'])}.json"))
        return entry["tree"]

    def entries(self) -> list[dict[str, Any]]:
        """The trial's indexed checkpoints, newest first (an unreadable entry is left out)."""
        index = self._index_dir()
        try:
            names = [Path(p).name for p in self.fs.ls(index, detail=False)]
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            if not name.startswith("step-") or not name.endswith(".json"):
                continue
            try:
                raw = self.fs.cat_file(self.fs.join(index, name))
                entry = json.loads(raw[:MAX_ENTRY_BYTES]) if len(raw) <= MAX_ENTRY_BYTES else None
                if isinstance(entry, dict) and isinstance(entry.get("step"), int) and isinstance(entry.get("tree"), str):
                    found.append(entry)
            except (OSError, ValueError):
                continue
        return sorted(found, key=lambda e: -e["step"])

    def pull(self, entry: dict[str, Any], into: Path) -> Path:
        """Check the entry's checkpoint out into `into` (whole, then renamed into view)."""
        from dvc_data.hashfile.checkout import checkout
        from dvc_data.hashfile.hash_info import HashInfo
        from dvc_data.hashfile.tree import Tree
        from dvc_objects.fs.local import LocalFileSystem

        odb = self._odb
        tree = Tree.load(odb, HashInfo("md5", entry["tree"]))
        final = into / step_dir_name(entry["step"])
        partial = into / f"{TMP_PREFIX}{os.getpid()}-{final.name}"  # ranks of one node may pull at once
        shutil.rmtree(partial, ignore_errors=True)
        into.mkdir(parents=True, exist_ok=True)
        checkout(str(partial), LocalFileSystem(), tree, odb)
        if final.exists() and verify(final) is None:  # another process of this node pulled it first
            shutil.rmtree(partial, ignore_errors=True)
            return final
        shutil.rmtree(final, ignore_errors=True)  # a local copy that does not verify: the remote's replaces it
        partial.rename(final)
        fsync_dir(into)
        return final

    def pull_newer(self, into: Path, than: int) -> Path | None:
        """The newest indexed checkpoint newer than step `than` that verifies (manifest and
        signature), pulled into `into`; None if there is none. A checkpoint that cannot be
        pulled or does not verify is said, removed, and the next older one tried."""
        for entry in self.entries():
            if entry["step"] <= than:
                return None
            try:
                path = self.pull(entry, into)
            except Exception as e:  # a missing object, an unreachable remote
                problem = f"cannot pull it ({e})"
            else:
                problem = verify(path)
                if problem is None:
                    print(f"pulled checkpoint step {entry['step']} (tree {entry['tree']}) from {self.url}", flush=True)
                    return path
                shutil.rmtree(path, ignore_errors=True)
            print(f"checkpoint remote {self.url}: step {entry['step']} refused: {problem}; trying an older one",
                  file=sys.stderr, flush=True)
        return None

    def pull_step(self, step: int, into: Path) -> Path | None:
        """Step `step`'s checkpoint pulled into `into`, if the remote indexes it."""
        entry = next((e for e in self.entries() if e["step"] == step), None)
        return None if entry is None else self.pull(entry, into)


def remote_for(spec: dict[str, Any] | None, keep: int) -> CheckpointRemote | None:
    """The trial config's `checkpoint_remote` ({"url", "key"}) as a remote; None without one."""
    return None if not spec else CheckpointRemote(spec["url"], spec["key"], keep)


def resolve_remote(value: str, repo: Path | None = None) -> str:
    """A remote's URL from `tracking.dvc_remote`: the name of a remote in the DVC project's
    config (`dvc remote add`), a URL, or a local path (made absolute)."""
    if "://" in value:
        return value
    if not value.startswith((".", "/", "~")):
        url = _named_remote(value, repo or Path.cwd())
        if url is not None:
            return url
    return str(Path(value).expanduser().resolve())


def _named_remote(name: str, repo: Path) -> str | None:
    if not (repo / ".dvc").is_dir():
        return None
    from dvc.config import Config

    try:
        remote = Config(dvc_dir=str(repo / ".dvc")).get("remote", {}).get(name)
    except Exception:  # an unreadable DVC config: treated as no such remote
        return None
    if not remote or "url" not in remote:
        return None
    url = remote["url"]
    if "://" not in url and not os.path.isabs(url):  # relative to the .dvc folder, as DVC reads it
        url = str((repo / ".dvc" / url).resolve())
    return url


def check_remote(url: str) -> None:
    """Write and remove a probe under the remote's index: RemoteError if it cannot."""
    remote = CheckpointRemote(url, "probe")
    probe = remote.fs.join(remote.root, INDEX, f".probe-{os.getpid()}")
    try:
        remote.fs.makedirs(remote.fs.join(remote.root, INDEX), exist_ok=True)
        remote.fs.pipe_file(probe, b"{}")
        remote.fs.rm(probe)
    except Exception as e:
        raise RemoteError(f"{url}: {e}") from None
