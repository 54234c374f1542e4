"""What the elastic trial's stop check costs a training step, 2 processes side by side.

    .venv/bin/python bench/control_cost.py [--width 16] [--batch-size 64]

An elastic trial asks every `control_every` (10) steps whether its agent wants it to stop,
and every rank must stop at the same step. The check as it was broadcast rank 0's answer
and waited for it: a round trip between the ranks on the training path.
training/elastic_worker.StopFlag has rank 0 look for the agent's file and name a later step
in a file of its own; the ranks read it with no collective and no round trip.

Runs the real Trainer (SmallCNN, dropout 0.1, gloo, 2 processes for 2 logical ranks, each
pinned to a core, fed by the trainer's own feed) and alternates blocks of steps with: no
check, the waited check, StopFlag. Prints, for each, the median wall time per step of its
blocks (its ratio to no check) and how much longer a step carrying a check takes than the
steps without one. Read the second: it compares steps
of the same blocks, while whole blocks move with the load of a shared host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BLOCK, BLOCKS, CONTROL_EVERY = 100, 30, 10


def waited_check(store, key: str, rank: int):
    """The check as it was: rank 0's answer broadcast and waited for at the same step."""
    import torch
    import torch.distributed as dist

    def should_stop(step: int) -> bool:
        flag = torch.tensor([1 if rank == 0 and store.check([key]) else 0])
        dist.broadcast(flag, src=0)
        return bool(flag.item())
    return should_stop


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from training.config import TrialConfig
    from training.elastic_worker import StopFlag
    from training.trainer import DistEnv, Trainer

    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=rank == 0, world_size=2, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=2)
    cfg = TrialConfig(trial_id="control-cost", seed=0, model={"name": "small_cnn", "width": args.width, "dropout": 0.1},
                      data={"path": args.data}, logical_ranks=2, steps=10**9, batch_size=args.batch_size, lr=0.05,
                      warmup_steps=20, trial_dir=str(Path(args.control) / f"trial-rank{rank}"), checkpoint_every=10**9,
                      eval_every=10**9)
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.attach(DistEnv(rank, 2, 0))
    batches = iter(trainer.feed.batches(0, cfg.steps, trainer.spans))  # as Trainer.train feeds its steps
    flag = StopFlag(Path(args.control) / "stop-0", rank, CONTROL_EVERY, torch.device("cpu"))  # no agent here: the file never comes
    checks = {"no check": None, "waited check": waited_check(store, "stop", rank), "StopFlag": flag}
    names = list(checks)
    per_block: dict[str, list[float]] = {name: [] for name in names}
    at_check: dict[str, list[float]] = {name: [] for name in names}  # steps that carry a check
    between: dict[str, list[float]] = {name: [] for name in names}  # the other steps
    step = 0
    for block in range(BLOCKS + 1):  # block 0 warms up
        for name in names[block % 3:] + names[:block % 3]:  # each variant in each position in turn
            check = checks[name]
            dist.barrier()
            began = last = time.perf_counter()
            for _ in range(BLOCK):
                checked = step % CONTROL_EVERY == 0
                if checked and check is not None:
                    assert not check(step)
                trainer.train_step(step, batches)
                step += 1
                now = time.perf_counter()
                if block:
                    (at_check if checked else between)[name].append(now - last)
                last = now
            if block:
                per_block[name].append((time.perf_counter() - began) / BLOCK)
    if rank == 0:
        base = statistics.median(per_block["no check"])
        print(f"wall time per step, SmallCNN w{args.width}, batch {args.batch_size}, 2 processes, a check every "
              f"{CONTROL_EVERY} steps, {BLOCKS} rounds of {BLOCK}-step blocks (load average {os.getloadavg()[0]:.2f})")
        for name in names:
            median = statistics.median(per_block[name])
            excess = statistics.median(at_check[name]) - statistics.median(between[name])
            print(f"  {name:<13} {median * 1e6:6.0f} us per step (median block), x{median / base:.3f}; "
                  f"a step with a check takes {excess * 1e6:+5.0f} us more than one without")
    trainer.detach()
    trainer.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--data", default="")
    parser.add_argument("--control", default="")
    parser.add_argument("--store-port", type=int, default=29641)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from training.data import prepare_digits

    with tempfile.TemporaryDirectory(prefix="control-cost-") as tmp:
        data = prepare_digits(Path(tmp) / "digits.npz")
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", WORLD_SIZE="2", PYTHONPATH=str(REPO))
        command = [sys.executable, __file__, "--worker", "--data", str(data), "--control", tmp, "--width", str(args.width),
                   "--batch-size", str(args.batch_size), "--store-port", str(args.store_port)]
        procs = [subprocess.Popen(command, env=dict(env, RANK=str(r))) for r in range(2)]
        codes = [p.wait() for p in procs]
        if any(codes):
            sys.exit(f"a worker failed: exit codes {codes}")


if __name__ == "__main__":
    main()
