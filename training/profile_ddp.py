"""The distributed part of a profile: DDP's gradient buckets, all-reduce time and overlap.

    torchrun --nproc-per-node 2 -m training.profile_ddp --model small_cnn \\
        --model-kwargs '{"width": 16}' --batch-size 64 --steps 30 --out ddp.json

Trains `--steps` steps of the model on random digits-shaped data at the global batch,
split over the world size from torchrun's environment, exactly as the trainer does (same
loss scaling, SGD with momentum, DDP defaults). A DDP communication hook wrapping the
default all-reduce records, per step, each bucket's bytes and the interval its all-reduce
was in flight; post-accumulate-grad hooks mark the end of backward compute. On one node
the ranks' bucket-ready times also give how long the first rank waited for the last (a
straggler shows up there, not as a slow link). Before that, each rank trains a few steps
alone, then all together, without DDP: the ratio is how much ranks sharing a node slow
each other's compute. After, a short probe times bare all-reduces of a few sizes and fits
the link's bandwidth and latency.
Rank 0 writes a training.profiler.DdpProfile as JSON.

Times are host clocks: exact on CPU (gloo); on a GPU (NCCL) each phase is synchronised,
and bucket intervals are when the host saw them start and finish, an approximation.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from training.errors import CampaignError
from training.files import write_atomic
from training.outputs import as_objective
from training.workload import build_model, build_objective, datasets, move, sample_batch
from training.profiler import BucketProfile, DdpProfile, LinkEstimate
from training.roofline import cpu_threads
from training.train import pick_device
from training.trainer import DistEnv

# Sizes of the bare all-reduce probe: from latency-bound to bandwidth-bound.
PROBE_BYTES = tuple(4**k * 2**10 for k in range(1, 7))  # 4 KiB .. 4 MiB


def ring_bytes(buffer_bytes: int, world_size: int) -> float:
    """What each device sends in a ring all-reduce of `buffer_bytes`: 2(n-1)/n of it."""
    return 2 * (world_size - 1) / world_size * buffer_bytes


def fit_link(points: list[tuple[int, float]], world_size: int) -> LinkEstimate:
    """Least-squares fit of time = latency + ring_bytes / bandwidth over (bytes, seconds).

    Noise can make the slope non-positive on a tiny probe; then the largest point alone
    sets the bandwidth. Latency is never negative."""
    x = np.array([ring_bytes(b, world_size) for b, _ in points])
    t = np.array([s for _, s in points])
    slope, intercept = np.polyfit(x, t, 1) if len(points) > 1 else (0.0, 0.0)
    if slope <= 0:
        slope, intercept = t[-1] / x[-1], 0.0
    return LinkEstimate(world_size, float(1.0 / slope), float(max(0.0, intercept)), tuple((int(b), float(s)) for b, s in points))


def union_length(intervals: list[tuple[float, float]], lo: float = -np.inf, hi: float = np.inf) -> float:
    """Total length of the union of intervals, clipped to [lo, hi]."""
    total, end = 0.0, -np.inf
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


@dataclass(slots=True)
class _StepRecord:
    buckets: dict[int, tuple[int, tuple[str, ...]]] = field(default_factory=dict)  # index -> (bytes, params)
    intervals: list[tuple[float, float]] = field(default_factory=list)
    starts: dict[int, float] = field(default_factory=dict)  # bucket index -> when it was ready here
    grads_done: float = 0.0


class _CommRecorder:
    """A DDP comm hook (the default all-reduce) that records what each step sends and when."""

    def __init__(self, model: torch.nn.Module):
        self.names = {p: n for n, p in model.named_parameters()}
        self.step = _StepRecord()
        for p in self.names:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def new_step(self) -> _StepRecord:
        self.step = _StepRecord()
        return self.step

    def _grad_ready(self, _param: torch.Tensor) -> None:
        self.step.grads_done = max(self.step.grads_done, time.perf_counter())

    # No annotations: DDP rejects a hook whose `bucket` annotation is not the class itself,
    # and `from __future__ import annotations` turns it into a string.
    def hook(self, process_group, bucket):  # noqa: ANN001, ANN201
        record, start = self.step, time.perf_counter()
        buffer = bucket.buffer()
        params = tuple(self.names[p] for p in bucket.parameters())
        record.buckets[bucket.index()] = (buffer.numel() * buffer.element_size(), params)
        record.starts[bucket.index()] = start

        def finished(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            record.intervals.append((start, time.perf_counter()))
            return fut.value()

        return default_hooks.allreduce_hook(process_group, bucket).then(finished)


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def probe_link(device: torch.device, world_size: int, sizes: tuple[int, ...] = PROBE_BYTES, repeats: int = 20) -> LinkEstimate:
    """Time bare all-reduces of float32 buffers (median per size) and fit the link. Sizes
    take turns, so a burst of load on the host spreads over all of them, not one."""
    buffers = {size: torch.ones(size // 4, device=device) for size in sizes}
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for i in range(repeats + 2):
        for size, buf in buffers.items():
            dist.barrier()
            t0 = _sync(device)
            dist.all_reduce(buf)
            if i >= 2:  # the first rounds set up connections and buffers
                times[size].append(_sync(device) - t0)
    return fit_link([(size, statistics.median(times[size])) for size in sizes], world_size)


def _plain_step_times(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, steps: int, aligned: bool,
                      loss_fn=F.cross_entropy) -> list[float]:
    """Seconds of each training step without DDP (no communication). `aligned`: every rank
    starts each step together, after a barrier, as a synchronous DDP step would."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    objective = as_objective(loss_fn)
    times = []
    for i in range(steps + 2):
        optimizer.zero_grad(set_to_none=True)
        if aligned:
            dist.barrier()
        t0 = _sync(device)
        objective(model, x, y).backward()
        optimizer.step()
        if i >= 2:
            times.append(_sync(device) - t0)
    return times


def measure_corun_slowdown(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, env: DistEnv, device: torch.device, steps: int,
                           loss_fn=F.cross_entropy) -> float:
    """How much slower the slowest rank computes a step while every rank computes than a
    rank computes it alone.

    Ranks of one node share caches, memory bandwidth and, on a shared host, cores; and a
    synchronous step waits for the slowest of them. Each rank runs plain steps alone in
    turn, then all ranks run them together, step by step; the ratio compares the median
    of the per-step slowest rank with the median time alone."""
    if env.world_size == 1:
        return 1.0
    work = copy.deepcopy(model)
    alone = 0.0
    for turn in range(env.world_size):
        dist.barrier()
        if turn == env.rank:
            alone = statistics.median(_plain_step_times(work, x, y, device, steps, aligned=False, loss_fn=loss_fn))
    together = _max_over_ranks(_plain_step_times(work, x, y, device, steps, aligned=True, loss_fn=loss_fn), device)
    mean_alone = statistics.fmean(_gather(alone, env.world_size, device))
    return max(1.0, statistics.median(together) / mean_alone)


def _gather(value: float, world_size: int, device: torch.device) -> list[float]:
    out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([value], dtype=torch.float64, device=device))
    return [t.item() for t in out]


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _timed_steps(ddp: DDP, recorder: _CommRecorder, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, env: DistEnv, device: torch.device) -> list[list[float]]:
    """Train the trainer's step; per measured step (slowest rank): forward, backward,
    optimizer, step, all-reduce in flight, of it overlapping backward, of it peer wait."""
    optimizer = torch.optim.SGD(ddp.module.parameters(), lr=1e-3, momentum=0.9)
    # perf_counter is the host's monotonic clock, the same in every process of one node: there
    # the ranks' bucket-ready times compare, and the wait for the last rank can be measured.
    one_node = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)) == env.world_size
    rows = []
    for i in range(args.warmup + args.steps):
        optimizer.zero_grad(set_to_none=True)
        record = recorder.new_step()
        t0 = _sync(device)
        loss = args.loss_fn(ddp, x, y) * len(y) * env.world_size / args.batch_size
        t1 = _sync(device)
        loss.backward()
        t2 = _sync(device)
        optimizer.step()
        t3 = _sync(device)
        if i < args.warmup:
            continue
        comm = union_length(record.intervals, t1, t2)
        overlap = union_length(record.intervals, t1, max(t1, record.grads_done))
        starts = [record.starts[k] for k in sorted(record.starts)]
        latest = _max_over_ranks(starts, device) if one_node else starts
        wait = min(comm, sum(last - mine for last, mine in zip(latest, starts))) if one_node else math.nan
        rows.append(_max_over_ranks([t1 - t0, t2 - t1, t3 - t2, t3 - t0, comm, overlap, wait], device))
    return rows


def measure(args: argparse.Namespace, env: DistEnv, device: torch.device) -> DdpProfile:
    if args.batch_size < env.world_size or args.steps < 1:
        raise CampaignError(
            f"--batch-size {args.batch_size} and --steps {args.steps}: every rank needs a sample (batch >= world size "
            f"{env.world_size}) and at least one step must be measured"
        )
    torch.manual_seed(args.seed)
    model = build_model(args.workload["model"]).to(device)
    args.loss_fn = build_objective(args.workload["model"], args.workload.get("loss", {"name": "cross_entropy"}))
    local = len(np.array_split(np.arange(args.batch_size), env.world_size)[env.rank])
    x, y = (move(v, device) for v in sample_batch(datasets(args.workload["data"])[0], local))  # real samples
    corun = measure_corun_slowdown(model, x, y, env, device, args.steps // 2 + 1, args.loss_fn)

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    recorder = _CommRecorder(model)
    ddp.register_comm_hook(None, recorder.hook)
    rows = _timed_steps(ddp, recorder, x, y, args, env, device)
    link = probe_link(device, env.world_size, args.probe_bytes) if env.world_size > 1 else None

    med = [statistics.median(column) for column in zip(*rows)]
    buckets = tuple(BucketProfile(i, b, p) for i, (b, p) in sorted(recorder.step.buckets.items()))
    return DdpProfile(
        model=model_label(args.workload["model"]), world_size=env.world_size, backend=dist.get_backend(), global_batch=args.batch_size, steps=args.steps,
        buckets=buckets, allreduce_bytes=sum(b.bytes for b in buckets),
        forward_s=med[0], backward_s=med[1], optimizer_s=med[2], step_s=med[3], allreduce_s=med[4], overlap_s=med[5],
        peer_wait_s=None if math.isnan(med[6]) else med[6], corun_slowdown=corun,
        link=link, threads=torch.get_num_threads() if device.type == "cpu" else 0,
    )


def model_label(model: dict) -> str:
    return model.get("name") or model["target"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Measure DDP gradient buckets, all-reduce time and overlap at this world size.")
    parser.add_argument("--workload", type=json.loads, required=True,
                        help='JSON {"model": ..., "data": ..., "loss": ...} as in a trial config (training.workload)')
    parser.add_argument("--batch-size", type=int, required=True, help="global batch, split over the processes")
    parser.add_argument("--steps", type=int, default=30, help="measured steps (medians are reported)")
    parser.add_argument("--warmup", type=int, default=5, help="steps before measuring (DDP rebuilds its buckets after the first)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process on CPU (one CPU slot = one core)")
    parser.add_argument("--probe-bytes", type=lambda s: tuple(int(v) for v in s.split(",")), default=PROBE_BYTES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = DistEnv.from_environ()
    device = pick_device(env.local_rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        with cpu_threads(args.threads if device.type == "cpu" else None):
            profile = measure(args, env, device)
        if env.rank == 0:
            write_atomic(args.out, (profile.to_json() + "\n").encode())
            print(
                f"{profile.model} at world size {profile.world_size}: step {profile.step_s * 1e3:.3f} ms, "
                f"all-reduce {profile.allreduce_bytes} B in {profile.allreduce_s * 1e3:.3f} ms "
                f"({profile.overlap_fraction:.0%} overlapped); wrote {args.out}",
                flush=True,
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
