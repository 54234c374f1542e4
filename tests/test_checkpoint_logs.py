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


def test_a_checkpoint_logs_the_windows_still_in_flight_first(tmp_path, digits_npz):
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from test_checkpoint_logs import checkpoint_with_a_window_in_flight as f; "
            f"print('EVENTS ' + json.dumps(f({str(tmp_path / 'trial')!r}, {str(digits_npz)!r})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    events = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("EVENTS "))[len("EVENTS "):])
    assert events[0][:2] == ["log", 7] and "train_loss" in events[0][2], events  # logged first...
    assert events[1] == ["save", 7]  # ...then the checkpoint that covers it
    assert events[-1] == ["pending", 0]
