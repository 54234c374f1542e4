"""A checkpoint never covers a step whose metrics are not logged yet.

On a GPU the trainer copies a log window's loss to the host in the background and logs it
at a later log step, once it has landed. A checkpoint taken in between would let a kill
resume past that step, which nobody logs again: a hole in the trial's curves. The GPU's copy
is the one part faked here (an event that has not landed); the trainer, its checkpointer and
its metrics are the real ones, on the CPU, in a process of their own as a trial runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent


class NotLandedYet:
    """A CUDA event whose copy has not reached the host (query), until waited on."""

    def __init__(self) -> None:
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def checkpoint_with_a_window_in_flight(trial_dir: str, digits: str) -> list:
    """Save a checkpoint at step 7 while step 7's log window is still in flight; what the
    trial's metrics and checkpointer were asked to do, in order."""
    from test_host_sync import config
    from training.trainer import DistEnv, LogWindow, Trainer

    os.chdir(REPO)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    events: list = []
    try:
        trainer = Trainer(config(REPO / "params.yaml", Path(trial_dir), Path(digits)), torch.device("cpu"))
        trainer.attach(DistEnv(0, 1, 0))
        log, save = trainer.metrics.log, trainer.checkpointer.save

        def logged(step, **metrics):
            events.append(["log", step, sorted(metrics)])
            return log(step, **metrics)

        def saved(step, *args, **kwargs):
            events.append(["save", step])
            return save(step, *args, **kwargs)

        trainer.metrics.log, trainer.checkpointer.save = logged, saved
        trainer.step = 7
        trainer._pending_logs.append(LogWindow(7, 0.1, 0.02, torch.tensor(0.25), landed_event=NotLandedYet()))
        trainer.save_checkpoint(blocking=True)
        events.append(["pending", len(trainer._pending_logs)])
        trainer.close()
    finally:
        dist.destroy_process_group()
    return events


def in_a_process_of_its_own(function: str, *args: str) -> object:
    """`function` of this module called with `args` in a new Python process, as a trial runs
    (torch.distributed and DataLoader forks stay out of pytest's process); what it returned."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from test_checkpoint_logs import {function} as f; print('RETURNED ' + json.dumps(f(*{list(args)!r})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RETURNED "))[len("RETURNED "):])


def test_a_checkpoint_logs_the_windows_still_in_flight_first(tmp_path, digits_npz):
    events = in_a_process_of_its_own("checkpoint_with_a_window_in_flight", str(tmp_path / "trial"), str(digits_npz))
    assert events[0][:2] == ["log", 7] and "train_loss" in events[0][2], events  # logged first...
    assert events[1] == ["save", 7]  # ...then the checkpoint that covers it
    assert events[-1] == ["pending", 0]


def _train_on_two(rank: int, trial_dir: str, digits: str) -> None:
    from elastic_helpers import trial_config
    from training.trainer import DistEnv, Trainer

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{trial_dir}-rendezvous", rank=rank, world_size=2)
    try:
        cfg = trial_config(Path(trial_dir), Path(digits), model={"name": "mlp", "width": 32, "depth": 3}, steps=20, log_every=10,
                           eval_every=10, trace=False, checkpoint_every=1000, async_checkpoints=False)
        trainer = Trainer(cfg, torch.device("cpu"))
        trainer.attach(DistEnv(rank, 2, 0))
        trainer.train()
        if rank == 0:
            (Path(trial_dir) / "latest-at-the-end.json").write_text(json.dumps(trainer.latest))
        trainer.detach()
        trainer.close()
    finally:
        dist.destroy_process_group()


def latest_after_a_resume(trial_dir: str, digits: str) -> dict:
    """Train 20 steps on two processes, then resume the final checkpoint on one: the latest
    metrics at the end on rank 0, and those the resume read back."""
    import torch.multiprocessing as mp

    from elastic_helpers import trial_config
    from training.trainer import DistEnv, Trainer

    os.chdir(REPO)
    mp.spawn(_train_on_two, args=(trial_dir, digits), nprocs=2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = trial_config(Path(trial_dir), Path(digits), model={"name": "mlp", "width": 32, "depth": 3}, steps=20, log_every=10,
                           eval_every=10, trace=False, checkpoint_every=1000, async_checkpoints=False)
        trainer = Trainer(cfg, torch.device("cpu"))
        trainer.attach(DistEnv(0, 1, 0))
        step = trainer.resume()
        resumed = dict(trainer.latest)
        trainer.close()
    finally:
        dist.destroy_process_group()
    return {"step": step, "end": json.loads((Path(trial_dir) / "latest-at-the-end.json").read_text()), "resumed": resumed}


@pytest.mark.slow
def test_a_checkpoint_of_several_processes_keeps_rank_0s_latest_metrics(tmp_path, digits_npz):
    """Only rank 0 fills the latest metrics (the result is made of them); a checkpoint keeps one
    copy of them, from whichever rank DCP's de-duplication picks (here, for this model, rank 1):
    resumed from it, a trial must read rank 0's, not an empty set."""
    found = in_a_process_of_its_own("latest_after_a_resume", str(tmp_path / "trial"), str(digits_npz))
    assert found["step"] == 20 and "train_loss" in found["end"]
    assert found["resumed"] == found["end"]
