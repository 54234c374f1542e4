"""The char-GPT example as a researcher's own loop: `training.target` runs `train(ctx, ...)`.

Nothing here imports the project's trainer: a plain PyTorch DDP loop that asks the context
for its place (rank, world size, device), reports metrics, saves and loads checkpoints and
stops when asked. `examples/chargpt_loop.yaml` runs it; `bench/function_overhead.py` runs
the same function as a plain script (`ScriptContext`) to measure what the campaign costs.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from examples.workloads.chargpt import gpt, stdlib_text


def train(ctx, block: int = 128, layers: int = 4, dim: int = 128, heads: int = 4, dropout: float = 0.1,
          chars: int = 2_000_000, batch_size: int = 32, lr: float = 1e-3, warmup: int = 30,
          eval_every: int = 100, save_every: int = 100, eval_batches: int = 8, log_every: int = 10):
    steps = ctx.steps
    train_set, val_set = stdlib_text(block, chars)
    model = gpt(block, layers, dim, heads, dropout).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    step = 0
    if (saved := ctx.load()) is not None:  # resumed: a kill, a resize or a retry
        step, state = saved
        model.load_state_dict(state["model"]), opt.load_state_dict(state["opt"]), sched.load_state_dict(state["sched"])
    net = DDP(model) if ctx.world_size > 1 else model
    sampler = DistributedSampler(train_set, ctx.world_size, ctx.rank, seed=ctx.config.get("seed", 0), drop_last=True)
    loader = DataLoader(train_set, batch_size=batch_size // ctx.world_size, sampler=sampler, drop_last=True)
    epoch, batches, window = step * batch_size // len(train_set), None, torch.zeros((), device=ctx.device)
    while step < steps:
        if batches is None:
            sampler.set_epoch(epoch)
            batches = iter(loader)
        try:
            x, y = next(batches)
        except StopIteration:
            epoch, batches = epoch + 1, None
            continue
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step()
        step += 1
        window += loss.detach()
        if step % log_every == 0:  # one host read per log_every steps
            ctx.report(step, train_loss=window / log_every, lr=sched.get_last_lr()[0])
            window.zero_()
        if step % eval_every == 0 or step == steps:
            ctx.report(step, val_loss=evaluate(model, val_set, batch_size, eval_batches, ctx.device))
        stop = ctx.should_stop()  # pruned, or the campaign wants the devices: save, then return
        if step % save_every == 0 or step == steps or stop:
            ctx.save(step, {"model": model, "opt": opt, "sched": sched.state_dict()})
        if stop:
            return


@torch.no_grad()
def evaluate(model, val_set, batch_size: int, batches: int, device) -> float:
    model.eval()
    losses = [F.cross_entropy(model(x.to(device)).flatten(0, 1), y.to(device).flatten()).item()
              for x, y in itertools.islice(DataLoader(val_set, batch_size=batch_size), batches)]
    model.train()
    return sum(losses) / len(losses)


def check(ctx, **kwargs):
    """The campaign's dry run: one step on two samples, one report, one save."""
    block = kwargs.get("block", 128)
    train(ctx, **{**kwargs, "chars": 12 * (block + 1), "batch_size": 2, "eval_every": 1, "save_every": 1, "eval_batches": 1,
                  "log_every": 1, "warmup": 1})
