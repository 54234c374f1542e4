"""Entry point: `torchrun --nproc-per-node N -m training.train --config trial.json`.

Parses, builds, resumes from the latest valid checkpoint if any, trains, and always
closes the process group.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from training.result import read_result
from training.config import TrialConfig
from training.failure import failures_recorded, targets_of, user_packages
from training.fence import stops_when_fenced, watch_lease
from training.loopback import BIND_ENV, patch_torch_stores
from training.metrics import result_line
from training.process import die_with_parent, dump_stacks_on_request, skip_final_collection
from training.trainer import DistEnv, Trainer


def pick_device(local_rank: int) -> torch.device:
    """This process's device: its GPU, or its CPU slot (a core it is pinned to)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    cores = [int(c) for c in os.environ.get("CAMPAIGN_CPU_CORES", "").split(",") if c]
    if cores:
        os.sched_setaffinity(0, {cores[local_rank % len(cores)]})
        torch.set_num_threads(1)  # one slot is one core
    return torch.device("cpu")


def finished_result(cfg: TrialConfig) -> dict | None:
    """The trial's result if it finished: a valid result signed by this host's key (its
    checkpoints need not verify). One that is not (unsigned, forged, malformed) reads as none:
    the trainer then resumes from the final checkpoint and writes it again (training.result)."""
    return read_result(cfg.trial_dir, cfg.trial_id)


class StopFile:
    """A trial across nodes stops for a resize once its stop file is there: rank 0 looks at
    each control step and every rank follows its answer (a broadcast of one flag per control
    step: a file one node wrote is not seen in time by the others' ranks, on storage shared
    over the network, to agree on a step by files alone as the one-node agent's StopFlag does)."""

    def __init__(self, path: Path, trainer: Trainer):
        self.path, self.trainer = path, trainer

    def __call__(self, step: int) -> bool:
        return self.trainer.agree(self.trainer.is_rank0 and self.path.exists())

    def requested(self) -> bool:
        """Asked to stop (a held trainer goes on to its stop step)."""
        return self.path.exists()


def train_trial(cfg: TrialConfig, env: DistEnv, device: torch.device) -> None:
    """Resume (if a checkpoint exists) and train one trial on the process group already
    initialized; rank 0 writes the result. Used by torchrun's workers and the warm workers."""
    if finished_result(cfg) is not None:  # nothing completed is recomputed
        if env.rank == 0:
            print(f"trial {cfg.trial_id}: already finished, nothing to do", flush=True)
        return
    if cfg.function is not None:
        train_function(cfg, env, device)
        return
    trainer = None
    try:
        trainer = Trainer(cfg, device)
        trainer.attach(env)
        resumed = trainer.resume()
        if env.rank == 0:
            print(f"trial {cfg.trial_id}: world size {env.world_size}, " + (f"resumed at step {resumed} from {trainer.checkpointer.loaded}" if resumed is not None else "fresh start"), flush=True)
        result = trainer.train(StopFile(Path(cfg.stop_path), trainer) if cfg.stop_path else None)
        if result is None:  # asked to stop (its campaign moves it to other nodes): at a checkpoint
            trainer.save_checkpoint(blocking=True)
            if env.rank == 0:
                print(f"trial {cfg.trial_id}: stopped at step {trainer.step} for a resize (checkpoint saved)", flush=True)
        elif env.rank == 0:
            print(result_line(cfg.trial_id, result), flush=True)
        trainer.detach()
    finally:
        if trainer is not None:
            trainer.close()


def train_function(cfg: TrialConfig, env: DistEnv, device: torch.device) -> None:
    """A function trial (training.function): the user's loop, with our checkpoints and metrics."""
    from training.function import FunctionTrial

    trial = FunctionTrial(cfg, device)
    try:
        trial.attach(env.rank, env.world_size, env.local_rank)
        if env.rank == 0:
            print(f"trial {cfg.trial_id}: world size {env.world_size}, calling {cfg.function['target']}", flush=True)
        result = trial.train()
        if env.rank == 0:
            print(result_line(cfg.trial_id, result) if result is not None else
                  f"trial {cfg.trial_id}: stopped at step {trial.step} (SIGTERM: the campaign is stopping); it resumes from its last save",
                  flush=True)
    finally:
        trial.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train one trial with DDP.")
    parser.add_argument("--config", required=True, help="trial JSON written by the campaign (training.config.TrialConfig)")
    args = parser.parse_args(argv)
    die_with_parent()  # torchrun gives workers their own session: never outlive it
    skip_final_collection()  # a trial's end is seen when its processes have exited
    dump_stacks_on_request()  # a stalled trial's stacks, to its log (tasks/watchdog.py)
    cfg = TrialConfig.from_file(args.config)
    watch_lease(cfg.lease)  # before anything touches the device: a stalled campaign's lease ends this worker
    env = DistEnv.from_environ()
    if finished_result(cfg) is not None:  # nothing completed is recomputed
        if env.rank == 0:
            print(f"trial {cfg.trial_id}: already finished, nothing to do", flush=True)
        return
    device = pick_device(env.local_rank)
    if os.environ.get(BIND_ENV):  # a trial across nodes: a store rank 0 hosts listens on its node's address only
        patch_torch_stores()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        # An exception says whose it is before its traceback reaches the log (training.failure):
        # the campaign retries a failure of ours, not one of the user's code or a full disk.
        with stops_when_fenced(), failures_recorded(cfg.trial_dir, env.rank, user_packages(targets_of(cfg))):
            train_trial(cfg, env, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
