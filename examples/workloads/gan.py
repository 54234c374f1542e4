"""Two optimizers in one loop: a small GAN learning a ring of eight Gaussians (synthetic data).

A loop the project's trainer cannot express (a generator and a discriminator, each with
its own optimizer, stepped in turn), run as a function trial: `examples/gan.yaml` searches
the two learning rates with ASHA on the maximum mean discrepancy between generated and
real samples (`mmd`, lower is better), which the function reports as it goes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def ring(n: int, generator: torch.Generator, modes: int = 8, radius: float = 2.0, spread: float = 0.05) -> torch.Tensor:
    angles = torch.randint(modes, (n,), generator=generator) * (2 * math.pi / modes)
    centres = torch.stack([angles.cos(), angles.sin()], 1) * radius
    return centres + spread * torch.randn(n, 2, generator=generator)


def mlp(inputs: int, outputs: int, width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, width), nn.LeakyReLU(0.2), nn.Linear(width, width), nn.LeakyReLU(0.2), nn.Linear(width, outputs))


def mmd(x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> float:
    """Maximum mean discrepancy with a Gaussian kernel: 0 when the two samples match."""
    k = lambda a, b: torch.exp(-torch.cdist(a, b).square() / (2 * scale ** 2)).mean()
    return float(k(x, x) + k(y, y) - 2 * k(x, y))


def train(ctx, noise: int = 8, width: int = 64, batch_size: int = 128, g_lr: float = 1e-3, d_lr: float = 1e-3,
          eval_every: int = 50, save_every: int = 100):
    data = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank draws its own real samples
    gen, disc = mlp(noise, 2, width).to(ctx.device), mlp(2, 1, width).to(ctx.device)
    g_opt = torch.optim.Adam(gen.parameters(), lr=g_lr, betas=(0.5, 0.999))
    d_opt = torch.optim.Adam(disc.parameters(), lr=d_lr, betas=(0.5, 0.999))
    step = 0
    if (saved := ctx.load()) is not None:
        step, state = saved
        gen.load_state_dict(state["gen"]), disc.load_state_dict(state["disc"])
        g_opt.load_state_dict(state["g_opt"]), d_opt.load_state_dict(state["d_opt"])
        data.manual_seed(1000 + ctx.rank + step)
    g, d = (DDP(gen), DDP(disc)) if ctx.world_size > 1 else (gen, disc)
    per_rank = batch_size // ctx.world_size
    fixed = ring(1024, torch.Generator().manual_seed(0)).to(ctx.device)  # what the generator is measured against
    probe = torch.randn(1024, noise, generator=torch.Generator().manual_seed(1)).to(ctx.device)
    while step < ctx.steps:
        real = ring(per_rank, data).to(ctx.device)
        fake = g(torch.randn(per_rank, noise, device=ctx.device))
        logits = d(torch.cat([real, fake.detach()]))  # one forward per backward: what DDP synchronises
        d_loss = F.softplus(-logits[:per_rank]).mean() + F.softplus(logits[per_rank:]).mean()  # the discriminator's step
        d_opt.zero_grad(set_to_none=True)
        d_loss.backward()
        d_opt.step()
        # The generator's step, through the updated discriminator (unwrapped: its gradients here are not used).
        g_loss = F.softplus(-disc(fake)).mean()
        g_opt.zero_grad(set_to_none=True)
        g_loss.backward()
        g_opt.step()
        step += 1
        if step % eval_every == 0 or step == ctx.steps:
            with torch.no_grad():
                ctx.report(step, d_loss=d_loss, g_loss=g_loss, mmd=mmd(gen(probe), fixed))
        stop = ctx.should_stop()  # pruned, or the campaign wants the devices: save, then return
        if step % save_every == 0 or step == ctx.steps or stop:
            ctx.save(step, {"gen": gen, "disc": disc, "g_opt": g_opt, "d_opt": d_opt})
        if stop:
            return


def check(ctx, **kwargs):
    """The campaign's dry run: two samples, one step, one report, one save."""
    train(ctx, **{**kwargs, "batch_size": 2, "eval_every": 1, "save_every": 1})
