"""Sharded, resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a directory `step-00000050/` holding DCP's files plus `manifest.json`
(sha256 and size of every file). It is written as `.tmp-step-00000050/` and renamed only
once every rank has written and rank 0 has written the manifest, so a visible checkpoint
is always complete; one whose files do not match its manifest is skipped, never loaded.
DCP reshards on load, so a checkpoint written at one world size loads at another.

With a remote (`tracking.dvc_remote`, training/checkpoint_remote.py) each checkpoint is
pushed once in view, and a resume pulls a newer one than its folder holds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from training.checkpoint_remote import CheckpointRemote

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from training.fence import Fenced
from training.files import DiskFull, available_bytes, disk_full_in, fsync_dir
from training.manifest import TMP_PREFIX, checkpoint_step, latest_valid_checkpoint, list_checkpoints, step_dir_name, write_manifest

REPLACED_PREFIX = ".replaced-"  # a whole checkpoint set aside while a new save of its step takes its place


class Checkpointer:
    """Saves and loads a trial's state; every rank calls every method (they are collective).

    `save(..., blocking=False)` returns once the state is staged (copied to CPU memory); the
    write runs in a background thread over `async_group`, a process group of its own so its
    collectives never interleave with training's (a process alone needs none: `background`).
    Rank 0 writes the manifest and renames the checkpoint into view when the write has
    completed on every rank (DCP writes its metadata only then). One save is in flight at a time.
    """

    def __init__(self, root: Path, keep: int, rank: int, world_size: int, async_group: "dist.ProcessGroup | None" = None,
                 guard: Callable[[], str | None] | None = None, grant: dict[str, Any] | None = None,
                 remote: "CheckpointRemote | None" = None, one_writer: bool = False, background: bool = False):
        self.root = Path(root)
        # Rank 0 writes every replicated item (DCP's dedup to the lowest rank): the whole
        # checkpoint is then in rank 0's folder, though the ranks' folders are on different
        # machines (a trial across nodes without shared storage; the others pull it to resume).
        self.one_writer = one_writer
        self.remote = remote  # pushed to after each save, pulled from before a resume
        # Asked on rank 0 just before a checkpoint becomes visible (training.fence.commit_guard);
        # the grant goes into its manifest, so a late write under an old grant is not trusted.
        self.guard = guard
        self.grant = grant
        self.keep = max(1, keep)
        self.rank = rank
        self.world_size = world_size
        self.async_group = async_group
        # Saves may be written in the background: over async_group, or by a process alone.
        self.background = async_group is not None or (background and world_size == 1)
        self._pending: Future | None = None
        self._finalized: Future | None = None
        self._pending_dir: Path | None = None  # where the save in flight writes (`.tmp-step-N`)
        self.loaded: Path | None = None  # the checkpoint the last load_latest read (a resume's record says which)
        self.last: Path | None = None  # the newest this trial wrote or loaded: what its result points at

    def _planner(self) -> DefaultSavePlanner | None:
        return DefaultSavePlanner(dedup_save_to_lowest_rank=True) if self.one_writer else None  # one per save: it keeps state

    @property
    def alone(self) -> bool:
        """One process writes the whole state: DCP plans and commits it without collectives
        (a handful of gloo round trips per save, ~3 ms of a short trial's end)."""
        return self.world_size == 1

    def _barrier(self) -> None:
        if dist.is_initialized() and not self.alone:
            dist.barrier()

    def _on_rank0(self, value: Any) -> Any:
        """Rank 0's value of something every rank must agree on."""
        if not dist.is_initialized() or self.alone:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def clean_stale(self) -> None:
        """Remove half-written checkpoints left by a run that was killed while saving, and put
        back a whole one that a kill caught set aside for its replacement (`_finalize`)."""
        if self.rank == 0 and self.root.is_dir():
            for aside in self.root.glob(f"{REPLACED_PREFIX}*"):
                final = aside.with_name(aside.name[len(REPLACED_PREFIX):])
                if final.exists():
                    shutil.rmtree(aside, ignore_errors=True)
                else:
                    aside.rename(final)
                    fsync_dir(self.root)
            for stale in self.root.glob(f"{TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
        self._barrier()

    def save(self, step: int, state: dict[str, Any], blocking: bool = True) -> Path:
        self.wait()
        self._drop_empty_leftovers(step)
        final = self.root / step_dir_name(step)
        tmp = self.root / f"{TMP_PREFIX}{step_dir_name(step)}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        if blocking or not self.background:
            with _room_for(tmp):
                dcp.save(state, checkpoint_id=tmp, planner=self._planner(), no_dist=self.alone)
                self._barrier()
                if self.rank == 0:
                    self._finalize(step, tmp, final)
            self._barrier()
            self.last = final
            return final
        with _room_for(tmp):  # staging copies to memory; a small file may be written already
            self._pending = dcp.async_save(state, checkpoint_id=tmp, process_group=self.async_group, planner=self._planner(),
                                           no_dist=self.alone)
        self._pending_dir = tmp
        if self.rank == 0:
            # The callback runs after waiters on the write wake up: it must hold its own
            # reference to the future it completes, not read it from self.
            finalized = self._finalized = Future()
            self._pending.add_done_callback(lambda done: self._finalize_when(done, step, tmp, final, finalized))
        self.last = final
        return final

    def _drop_empty_leftovers(self, step: int) -> None:
        """One writer: on a node other than rank 0's, each save leaves a folder holding one empty
        file per rank, never put in view. Its first rank drops those of earlier saves (done on
        every rank: the last save's wait() returned)."""
        if not self.one_writer or os.environ.get("GROUP_RANK", "0") == "0" or os.environ.get("LOCAL_RANK", "0") != "0":
            return
        for stale in self.root.glob(f"{TMP_PREFIX}*"):
            if checkpoint_step(stale.with_name(stale.name[len(TMP_PREFIX):])) < step:
                shutil.rmtree(stale, ignore_errors=True)

    def _finalize_when(self, done: Future, step: int, tmp: Path, final: Path, finalized: Future) -> None:
        try:
            done.result()
            self._finalize(step, tmp, final)
            finalized.set_result(final)
        except BaseException as e:  # surfaced by wait(), on the training thread
            finalized.set_exception(e)

    def _finalize(self, step: int, tmp: Path, final: Path) -> None:
        if self.guard is not None and (problem := self.guard()) is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # written by a holder that lost its lease: never in view
            raise Fenced(problem)
        write_manifest(tmp, step, self.world_size, self.grant)
        # The same step saved again (a resize or a move stopping on a checkpoint step, a
        # resume's final save): the whole old one is set aside by a rename, not deleted, until
        # the new one is in its place; a kill in between leaves it for clean_stale to put back
        # (deleting first left nothing to resume from but older steps).
        aside = final.with_name(f"{REPLACED_PREFIX}{final.name}")
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
            final.rename(aside)
        tmp.rename(final)
        fsync_dir(self.root)
        shutil.rmtree(aside, ignore_errors=True)
        for old in list_checkpoints(self.root)[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        if self.remote is not None:
            try:
                self.remote.push(final)
            except Exception as e:  # the checkpoint is whole here: training goes on, a resume elsewhere starts older
                print(f"checkpoint remote {self.remote.url}: pushing {final.name} failed ({e}); it stays on this node",
                      file=sys.stderr, flush=True)

    def newest(self) -> Path | None:
        """The newest checkpoint this trial wrote or loaded, else the newest in its folder (an
        elastic generation that took its state in memory and wrote none yet)."""
        return self.last or next(iter(list_checkpoints(self.root)), None)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and, on rank 0, visible."""
        writing, self._pending_dir = self._pending_dir, None
        with _room_for(writing) if writing is not None else contextlib.nullcontext():
            if self._pending is not None:
                pending, self._pending = self._pending, None
                pending.result()
            if self._finalized is not None:
                finalized, self._finalized = self._finalized, None
                finalized.result()

    def latest(self) -> Path | None:
        """The newest valid checkpoint as rank 0 finds it, on every rank (collective). With a
        remote, rank 0 first pulls a newer one than its folder holds, and a rank whose node
        lacks the chosen one (no shared storage) pulls it too."""
        found = self._newest_on_rank0() if self.rank == 0 else None
        # Its name, not rank 0's path: without shared storage each node's folder may be elsewhere.
        name = self._on_rank0(found.name if found else None)
        if name is None:
            return None
        mine = self.root / name
        if self.remote is not None:
            if not mine.is_dir():
                self.remote.pull_step(checkpoint_step(mine), self.root)
            self._barrier()  # every rank has it before any loads
        return mine

    def _newest_on_rank0(self) -> Path | None:
        found = latest_valid_checkpoint(self.root)
        if self.remote is not None:
            try:
                pulled = self.remote.pull_newer(self.root, checkpoint_step(found) if found else -1)
            except Exception as e:  # unreachable now: this node's own checkpoints are all there is
                print(f"checkpoint remote {self.remote.url}: cannot read it ({e}); resuming from this node's checkpoints",
                      file=sys.stderr, flush=True)
                pulled = None
            if pulled is not None:
                found = latest_valid_checkpoint(self.root)  # verified like any other: a bad pull is skipped
        return found

    def load_latest(self, state: dict[str, Any]) -> int | None:
        """Load the newest valid checkpoint into `state`; its step, or None if there is none."""
        found = self.latest()
        if found is None:
            return None
        keys = set(dcp.FileSystemReader(found).read_metadata().state_dict_metadata)
        for value in state.values():  # what an older checkpoint lacks is not asked of it
            if hasattr(value, "checkpoint_has"):
                value.checkpoint_has(keys)
        dcp.load(state, checkpoint_id=found, no_dist=self.alone)
        self.loaded = self.last = found
        return checkpoint_step(found)


NEARLY_FULL_BYTES = 1 << 20  # a failed write that leaves less room than this found none


@contextlib.contextmanager
def _room_for(tmp: Path):
    """A save that finds no room (ENOSPC, EDQUOT: DCP wraps each rank's error in a
    CheckpointException whose text is a traceback) becomes a DiskFull naming the checkpoint's
    folder, its file system's free space and the fix; the half-written folder is removed, so
    the room it took goes back at once (for the trial's failure record; a resume would remove
    it anyway). Any other error passes as it came."""
    try:
        yield
    except BaseException as e:  # CheckpointException is a BaseException
        full = disk_full_in(e, tmp, "the checkpoint ")
        if full is None and isinstance(e, (dcp.api.CheckpointException, RuntimeError)):
            # torch's file writer may report a failed write in its own words only ("file write
            # failed", "unexpected pos"): a file system left without room after it says why.
            if (left := available_bytes(tmp)) is not None and left < NEARLY_FULL_BYTES:
                full = DiskFull(tmp, what="the checkpoint ")
        if full is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise full from e


def load_model_weights(checkpoint: Path, model: "torch.nn.Module") -> "torch.nn.Module":
    """Load only the model's weights from a trial checkpoint, in one process (export, tests)."""
    state = {"trainer": {"model": model.state_dict()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    model.load_state_dict(state["trainer"]["model"])
    return model
