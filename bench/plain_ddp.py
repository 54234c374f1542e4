"""A plain hand-written DDP loop: the baseline that our trainer's overhead is measured against.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/plain_ddp.py \\
        --data data/digits.npz --steps 600 --width 32 --batch-size 128 --timing-out plain.json

What a person would write without the campaign: the same model (training.workload.build_model
of {"name": "small_cnn", "width": ..., "dropout": ...}, so the same SmallCNN and nn.Dropout),
the same digits .npz, each step's global batch taken from a per-epoch permutation and split
contiguously across ranks, mean loss per rank (DDP averages the gradients: with equal
shards, the gradient of the global mean), SGD with momentum and a warm-up + cosine learning
rate. No logging, no checkpoints, no evaluation, no progress file. Each rank is pinned to
one core with one thread, as the trainer pins a CPU slot (`--cores`), so both loops run on
the same resources.

Rank 0 writes the wall time at which each step completed (`time.time()`, after the
optimizer step) to `--timing-out`, so the bench can time any window of steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: find training/

from training.workload import build_model  # noqa: E402


def lr_lambda(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plain DDP training loop (benchmark baseline).")
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cores", default="", help="comma-separated cores: rank i is pinned to the i-th")
    parser.add_argument("--timing-out", type=Path, help="rank 0 writes each step's completion wall time here")
    args = parser.parse_args(argv)

    rank, world, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    cores = [int(c) for c in args.cores.split(",") if c]
    if cores:
        os.sched_setaffinity(0, {cores[local_rank % len(cores)]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo")

    with np.load(args.data) as f:
        train_x, train_y = torch.from_numpy(f["train_x"]), torch.from_numpy(f["train_y"])
    torch.manual_seed(args.seed)
    model = DDP(build_model({"name": "small_cnn", "width": args.width, "dropout": args.dropout}))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, args.steps))

    if args.batch_size % world:
        parser.error(f"--batch-size {args.batch_size} must split evenly over {world} ranks")
    n, shard = len(train_y), args.batch_size // world
    generator = torch.Generator().manual_seed(args.seed)
    perm, position = torch.randperm(n, generator=generator), 0
    done_at: list[float] = []
    for _ in range(args.steps):
        if position + args.batch_size > n:  # a new epoch: a new permutation (the tail is dropped)
            perm, position = torch.randperm(n, generator=generator), 0
        idx = perm[position + rank * shard: position + (rank + 1) * shard]
        position += args.batch_size
        loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if rank == 0:
            done_at.append(time.time())

    if rank == 0 and args.timing_out is not None:
        args.timing_out.write_text(json.dumps({"done_at": done_at}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
