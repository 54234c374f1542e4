"""`exact` reduction: the logical ranks' gradients summed in one fixed order.

DDP's all-reduce sums the processes' gradients in an order that depends on how many
processes there are (and one process accumulating two logical ranks adds them in yet
another order), so results at different process counts agree only to float rounding.
Here each logical rank's gradient is kept in a slot of its own; every process's slots are
gathered, and every process sums them in logical order, 0, 1, ..., L-1. Each logical rank's
forward and backward pass is the same computation wherever it runs, so the sum, and the
whole run, is bit for bit the same at any number of processes (on one device type, with
deterministic algorithms). The price: L gradient-sized slots of memory and an all-gather of
them instead of an all-reduce of one.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from training.data import shard_bounds


class OrderedReduction:
    """One process's slots of logical-rank gradients, and their ordered sum across processes."""

    def __init__(self, params, logical_ranks: int, world_size: int, rank: int, device: torch.device):
        self.params = [p for p in params if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"exact reduction needs parameters of one dtype, the model has {sorted(map(str, dtypes))}")
        self.world_size = world_size
        self.numel = sum(p.numel() for p in self.params)
        self.per_rank = math.ceil(logical_ranks / world_size)  # slots per process, padded to the largest share
        self.first, _ = shard_bounds(logical_ranks, world_size, rank)
        self.local = torch.zeros(self.per_rank, self.numel, dtype=dtypes.pop(), device=device)
        # Logical rank l lives in row (its process) * per_rank + (its place there): in logical order.
        held = [hi - lo for lo, hi in (shard_bounds(logical_ranks, world_size, r) for r in range(world_size))]
        self.rows = [r * self.per_rank + j for r, count in enumerate(held) for j in range(count)]

    def take(self, logical_rank: int) -> None:
        """Move the gradients accumulated for `logical_rank` into its slot; the next starts from none."""
        row = self.local[logical_rank - self.first]
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                row[offset:offset + n].zero_()
            else:
                row[offset:offset + n].copy_(p.grad.reshape(-1))
                p.grad = None
            offset += n

    def reduce(self, slot_norms: bool = False) -> torch.Tensor | None:
        """Every process: p.grad = the sum of all logical ranks' slots, in logical order
        (collective). `slot_norms`: also return each logical rank's |slot|², in logical
        order, on the device (training.noise_scale's small-batch gradients)."""
        if self.world_size > 1:
            parts = [torch.empty_like(self.local) for _ in range(self.world_size)]
            dist.all_gather(parts, self.local)
            slots = torch.cat(parts)
        else:
            slots = self.local
        norms = torch.linalg.vector_norm(slots, dim=1).square()[self.rows] if slot_norms else None
        total = slots[self.rows[0]].clone()
        for r in self.rows[1:]:
            total.add_(slots[r])
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = total[offset:offset + n].view_as(p)
            offset += n
        return norms
