"""The trainer's fixed cost per step: CPU microseconds that `Trainer.train_step` adds to a
plain step (index, forward, loss, backward, optimizer) on the same model, in one process.

    .venv/bin/python bench/step_cost.py

Why it exists: elastic_bench's overhead part times whole runs, and on a shared host the
pairs scatter by several percent; the cost that makes the difference between a 3 ms and
a 10 ms step is a fixed amount per step (the trainer's feed walking the global sample
order in its logical ranks' spans, the per-step seed of each logical rank, the loss scale,
the precision and gradient-scaler wrappers, even when they do nothing). Here both steps
alternate in blocks in one process pinned to one core (world size 1, gloo, one logical
rank), measured in CPU time, on a model so small that this fixed cost is most of what
differs. Both steps run the same model with its ordinary nn.Dropout (the trainer draws no
masks of its own), so the difference is the trainer's bookkeeping alone; printed with
dropout off and on.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BLOCK, BLOCKS, BATCH = 2000, 7, 8


def measure(dropout: float, data: Path) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    from training.config import TrialConfig
    from training.trainer import DistEnv, Trainer

    cfg = TrialConfig(trial_id="step-cost", seed=0, model={"name": "small_cnn", "width": 2, "dropout": dropout},
                      data={"path": str(data)}, steps=10**9, batch_size=BATCH, lr=0.05, warmup_steps=20,
                      trial_dir=tempfile.mkdtemp(prefix="step-cost-"), checkpoint_every=10**9, eval_every=10**9)
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.attach(DistEnv(0, 1, 0))
    model, optimizer = trainer.model, trainer.optimizer  # one process: no DDP wrapper in either step
    train_x, train_y = trainer.train_set.tensors  # the built-in digits: a TensorDataset
    order = torch.randperm(len(train_y))

    def plain(step: int) -> None:
        start = (step * BATCH) % (len(order) - BATCH)
        idx = order[start:start + BATCH]
        loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        trainer.scheduler.step()

    # Ours as Trainer.train drives it: the trainer's own feed yields each step's micro-batches.
    batches = iter(trainer.feed.batches(0, cfg.steps, trainer.spans))
    counter = itertools.count()

    def ours(_: int) -> None:
        trainer.train_step(next(counter), batches)

    steps = {"ours": ours, "plain": plain}
    cpu_us: dict[str, list[float]] = {name: [] for name in steps}
    for name, step in steps.items():  # warm both up
        for s in range(200):
            step(s)
    for _ in range(BLOCKS):
        for name, step in steps.items():
            began = time.process_time()
            for s in range(BLOCK):
                step(s)
            cpu_us[name].append((time.process_time() - began) / BLOCK * 1e6)
    trainer.detach()
    trainer.close()
    return statistics.median(cpu_us["ours"]), statistics.median(cpu_us["plain"])


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29631"), GLOO_SOCKET_IFNAME="lo",
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch
    import torch.distributed as dist

    from training.data import prepare_digits

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    with tempfile.TemporaryDirectory(prefix="step-cost-") as tmp:
        data = prepare_digits(Path(tmp) / "digits.npz")
        print(f"per-step CPU time, SmallCNN w2, batch {BATCH}, 1 process, median of {BLOCKS} blocks of {BLOCK} steps "
              f"(load average {os.getloadavg()[0]:.2f})")
        for dropout in (0.0, 0.1):
            ours, plain = measure(dropout, data)
            print(f"  dropout {dropout} (nn.Dropout in both): ours {ours:.1f} us, plain {plain:.1f} us "
                  f"-> fixed cost of ours {ours - plain:+.1f} us per step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
