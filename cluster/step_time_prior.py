"""The step-time prior: one DDP training step's time at n devices, predicted from a profile.

Data parallel with the global batch fixed, so each of n devices trains on B/n samples
(the largest shard when B does not divide: the slowest rank sets the pace).

    step(n) = (forward(b) + backward(b) + optimizer(b)) * co-run slowdown
              + exposed all-reduce + wait for the slowest rank + DDP overhead

- forward, backward and optimizer times at the per-device batch b come from the whole
  steps the profile measured at B, B/2, B/4, B/8, interpolated (measured time, not FLOPs
  over peak: small layers run far below the roofline, each step has a fixed cost, and the
  cost per sample changes as activations outgrow the caches).
- DDP all-reduces gradients bucket by bucket as backward produces them (last layers first).
  A bucket is ready once backward has passed its layers (the profile's per-layer backward
  times say when); its ring all-reduce then costs
        2(n-1) * hop_latency + 2(n-1)/n * bucket_bytes / bandwidth
  and all-reduces run one after the other. What ends after backward is exposed; of what
  runs during backward, a share (the overlap efficiency) is hidden: all of it where the
  transfers have their own engine (NCCL on a GPU), none where they take the rank's only
  core (gloo on a CPU slot).
- DDP also costs, at every size, one process included, a dispatch per bucket and the
  copies of the gradients into the buckets and back.
- A synchronous step waits for its slowest rank: a share of the compute, measured at a
  calibration world size, growing like the maximum of n samples of noise (sqrt(ln n)).
- Ranks on one node slow each other's compute (shared caches, memory bandwidth, cores):
  by a factor measured at a calibration world size, taken to grow linearly with the
  number of ranks a node holds (none by default: separate GPUs barely interfere).
- Across nodes the ring runs at the slower of the two links.

Pure: it reads the plain profile data (training.profiler) and imports neither torch nor
any I/O, so sizing and the simulator can use it anywhere.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.profiler import DdpProfile, ModelProfile

# DDP's defaults (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES and bucket_cap_mb=25): the
# first bucket is kept small so that communication starts early in backward.
FIRST_BUCKET_BYTES = 1 * 2**20
BUCKET_CAP_BYTES = 25 * 2**20


@dataclass(frozen=True, slots=True)
class LinkParams:
    """A link as a ring all-reduce sees it: per-device bandwidth and per-hop latency."""

    bandwidth_bytes_per_s: float
    hop_latency_s: float

    def allreduce_s(self, buffer_bytes: int, devices: int) -> float:
        if devices <= 1:
            return 0.0
        hops = 2 * (devices - 1)
        return hops * self.hop_latency_s + hops / devices * buffer_bytes / self.bandwidth_bytes_per_s

    @classmethod
    def slower(cls, a: "LinkParams", b: "LinkParams") -> "LinkParams":
        return cls(min(a.bandwidth_bytes_per_s, b.bandwidth_bytes_per_s), max(a.hop_latency_s, b.hop_latency_s))


# Documented defaults, used where nothing was measured (training.profile_ddp measures all
# of them: the link at 2+ processes, the per-bucket cost at 1):
# - CPU slots on one node talk through gloo over loopback TCP: about 1 GB/s and 50 us a
#   hop on an idle host (measure with training.profile_ddp at 2 processes to do better).
# - GPUs on one node: PCIe 4.0 x16 as NCCL reaches it, about 20 GB/s, 10 us a hop (NVLink
#   is several times faster: pass a measured link).
# - Between nodes: 10 Gb Ethernet, about 1.2 GB/s, 50 us a hop.
DEFAULT_INTRA_NODE = {"cpu": LinkParams(1e9, 50e-6), "cuda": LinkParams(20e9, 10e-6)}
DEFAULT_INTER_NODE = LinkParams(1.2e9, 50e-6)
# - Each bucket costs DDP a fixed dispatch (the reducer, the backend's queue), even alone:
#   about 150 us with gloo on a CPU core, 30 us with NCCL.
DEFAULT_BUCKET_OVERHEAD_S = {"cpu": 150e-6, "cuda": 30e-6}
# - DDP copies every gradient into its bucket and, after the all-reduce, back: two copies,
#   each a read and a write, at the device's memory bandwidth (one CPU core streams about
#   10 GB/s; a GPU's HBM about 1 TB/s). training.roofline.probe_device measures it.
DEFAULT_MEMORY_BYTES_PER_S = {"cpu": 10e9, "cuda": 1e12}
# - How much of the communication that overlaps backward in time is really hidden: on a
#   CPU slot gloo's transfers run on the rank's own core and steal it from backward (0);
#   NCCL runs on the GPU beside the compute kernels (1).
DEFAULT_OVERLAP_EFFICIENCY = {"cpu": 0.0, "cuda": 1.0}


@dataclass(frozen=True, slots=True)
class BatchCurve:
    """Seconds as a function of the per-device batch, through measured (batch, seconds) points.

    Between points: linear interpolation (the profile measures B, B/2, B/4, B/8, exactly
    the per-device batches of 1, 2, 4, 8 devices). Outside them: the line through the two
    nearest points, never below zero. Time never falls as the batch grows, so a point that
    timing noise put below a smaller batch's is raised to it."""

    points: tuple[tuple[int, float], ...]  # sorted by batch, non-decreasing in time

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> "BatchCurve":
        merged: dict[int, list[float]] = {}
        for batch, seconds in points:
            merged.setdefault(batch, []).append(seconds)
        out, floor = [], 0.0
        for batch in sorted(merged):
            floor = max(floor, statistics.median(merged[batch]))
            out.append((batch, floor))
        if not out:
            raise ValueError("a batch curve needs at least one measured point")
        return cls(tuple(out))

    def __call__(self, batch: float) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1] * batch / pts[0][0]  # one point: proportional
        if batch <= pts[0][0]:
            (b0, t0), (b1, t1) = pts[0], pts[1]
        elif batch >= pts[-1][0]:
            (b0, t0), (b1, t1) = pts[-2], pts[-1]
        else:
            i = next(i for i, (b, _) in enumerate(pts) if b >= batch)
            (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        return max(0.0, t0 + (t1 - t0) * (batch - b0) / (b1 - b0))


@dataclass(frozen=True, slots=True)
class Bucket:
    bytes: int
    ready_fraction: float  # of backward time elapsed when all its gradients exist


@dataclass(frozen=True, slots=True)
class StepTimeBreakdown:
    devices: int
    nodes: int
    per_device_batch: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    allreduce_s: float  # all buckets' ring all-reduces, end to end
    exposed_allreduce_s: float  # the part not hidden behind backward compute
    overhead_s: float  # DDP's own cost (bucket dispatch, gradient copies), at any size
    straggler_s: float = 0.0  # waiting for the slowest rank

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.exposed_allreduce_s + self.optimizer_s + self.overhead_s + self.straggler_s


def emulate_buckets(layers: Sequence[tuple[int, float]], first_cap: int = FIRST_BUCKET_BYTES, cap: int = BUCKET_CAP_BYTES) -> tuple[Bucket, ...]:
    """DDP's buckets from (gradient bytes, backward seconds) per layer in forward order.

    DDP fills buckets in reverse order of the parameters (the order backward produces
    them), closing a bucket when it reaches its cap; the first bucket has a smaller cap."""
    total_backward = sum(t for _, t in layers) or 1.0
    buckets: list[Bucket] = []
    filled, elapsed = 0, 0.0
    for grad_bytes, backward_s in reversed(layers):
        elapsed += backward_s
        if grad_bytes == 0:
            continue
        filled += grad_bytes
        if filled >= (first_cap if not buckets else cap):
            buckets.append(Bucket(filled, elapsed / total_backward))
            filled = 0
    if filled:
        buckets.append(Bucket(filled, 1.0))
    return tuple(buckets)


def measured_buckets(ddp: "DdpProfile", layers: Sequence[tuple[str, float]]) -> tuple[Bucket, ...]:
    """The buckets DDP actually built, each ready when backward has passed all its layers.
    `layers` are (name, backward seconds) in forward order; a parameter `a.b.weight` belongs
    to layer `a.b`; one on no profiled layer is taken as ready at the end of backward."""
    total = sum(t for _, t in layers) or 1.0
    done_at, elapsed = {}, 0.0
    for name, backward_s in reversed(layers):
        elapsed += backward_s
        done_at[name] = elapsed / total
    return tuple(
        Bucket(b.bytes, max((done_at.get(p.rpartition(".")[0], 1.0) for p in b.params), default=1.0))
        for b in sorted(ddp.buckets, key=lambda b: b.index)
    )


# --- what DDP measurements say (training.profile_ddp) ------------------------------------------

def link_from(runs: Sequence["DdpProfile"]) -> LinkParams | None:
    """The link at the largest world size measured (medians over its runs): bandwidth from
    the all-reduce probe; hop latency from the probe, or from the all-reduces inside the
    training steps where those cost more (cold caches after backward, threads woken from
    sleep, the backend's queue), after taking out the bandwidth part and the waiting for
    the slowest rank."""
    probed = [r for r in runs if r.link is not None]
    if not probed:
        return None
    n = max(r.world_size for r in probed)
    probed = [r for r in probed if r.world_size == n]
    hops = 2 * (n - 1)
    bandwidth = statistics.median(r.link.bandwidth_bytes_per_s for r in probed)
    hop_latency = statistics.median(r.link.latency_s for r in probed) / hops
    in_step = [
        (r.allreduce_s - r.peer_wait_s - sum(hops / n * b.bytes / bandwidth for b in r.buckets)) / (hops * len(r.buckets))
        for r in probed if r.buckets and r.peer_wait_s is not None
    ]
    if in_step:
        hop_latency = max(hop_latency, statistics.median(in_step))
    return LinkParams(bandwidth, hop_latency)


def straggler_fraction_from(runs: Sequence["DdpProfile"]) -> tuple[float, int] | None:
    """How long ranks wait for the slowest one, as a share of a step's compute (the mean over
    the runs of the largest world size), and that world size."""
    timed = [r for r in runs if r.world_size > 1 and r.peer_wait_s is not None]
    if not timed:
        return None
    n = max(r.world_size for r in timed)

    def fraction(r: "DdpProfile") -> float:
        compute = r.forward_s + r.backward_s - r.allreduce_s + r.overlap_s + r.optimizer_s
        return r.peer_wait_s / compute if compute > 0 else 0.0

    return statistics.fmean(fraction(r) for r in timed if r.world_size == n), n


def bucket_overhead_from(runs: Sequence["DdpProfile"]) -> float | None:
    """At world size 1 an all-reduce moves nothing: what it takes is DDP's dispatch."""
    singles = [r for r in runs if r.world_size == 1 and r.buckets]
    return statistics.fmean(r.allreduce_s / len(r.buckets) for r in singles) if singles else None


def corun_slowdown_from(runs: Sequence["DdpProfile"]) -> float | None:
    """The co-run slowdown per additional rank on a node."""
    shared = [r for r in runs if r.world_size > 1]
    return statistics.fmean((r.corun_slowdown - 1) / (r.world_size - 1) for r in shared) if shared else None


def buckets_of(profile: "ModelProfile", runs: Sequence["DdpProfile"]) -> tuple[Bucket, ...]:
    """The buckets DDP built, from a measurement of this very model (same gradient bytes,
    parameters of its layers); else DDP's bucketing emulated over the profile's layers."""
    layer_names = {l.name for l in profile.layers}
    for r in runs:
        if r.buckets and r.allreduce_bytes == profile.gradient_bytes and all(
            p.rpartition(".")[0] in layer_names for b in r.buckets for p in b.params
        ):
            return measured_buckets(r, [(l.name, l.backward_s) for l in profile.layers])
    buckets = emulate_buckets([(l.gradient_bytes, l.backward_s) for l in profile.layers])
    missing = profile.gradient_bytes - sum(b.bytes for b in buckets)  # parameters outside leaf layers
    return buckets + ((Bucket(missing, 1.0),) if missing > 0 else ())


@dataclass(frozen=True, slots=True)
class ProfileStepTimeModel:
    """cluster.types.StepTimeModel from a per-layer profile (and DDP measurements if any)."""

    global_batch: int
    forward: BatchCurve
    backward: BatchCurve
    optimizer: BatchCurve
    buckets: tuple[Bucket, ...]
    intra_node: LinkParams
    inter_node: LinkParams
    bucket_overhead_s: float = 0.0
    overlap_efficiency: float = 1.0  # share of the backward-overlapping communication hidden
    corun_slowdown_per_rank: float = 0.0  # compute slows by this for each other rank on the node
    memory_bytes_per_s: float = math.inf  # for DDP's gradient copies
    straggler_fraction: float = 0.0  # waiting for the slowest rank, as a share of compute ...
    straggler_world: int = 2  # ... at this world size

    @classmethod
    def from_profile(
        cls,
        profile: "ModelProfile",
        ddp: "DdpProfile | Sequence[DdpProfile] | None" = None,
        *,
        intra_node: LinkParams | None = None,
        inter_node: LinkParams | None = None,
        bucket_overhead_s: float | None = None,
        overlap_efficiency: float | None = None,
        corun_slowdown_per_rank: float | None = None,
        memory_bytes_per_s: float | None = None,
        straggler_fraction: float | None = None,
        straggler_world: int = 2,
    ) -> "ProfileStepTimeModel":
        """Build the prior from `profile` and, where given, DDP measurements of any model
        (training.profile_ddp) at any world sizes. Each parameter is, in order of preference:
        given here; measured (the link: the all-reduce probe of the largest world size and
        the all-reduces inside its steps; the straggler share: the same run; the per-bucket cost: the all-reduce time at world size 1; the co-run slowdown: runs at
        2+ processes; the buckets: those DDP built, if a measurement is of this model;
        memory bandwidth: pass DevicePeaks.peak_bytes_per_s); the documented default for
        the device kind."""
        kind = "cuda" if profile.device.startswith("cuda") else "cpu"
        runs = [] if ddp is None else [ddp] if not isinstance(ddp, Sequence) else list(ddp)
        if intra_node is None:
            intra_node = link_from(runs)
        if straggler_fraction is None:
            straggler_fraction, straggler_world = straggler_fraction_from(runs) or (0.0, 2)
        if bucket_overhead_s is None:
            bucket_overhead_s = bucket_overhead_from(runs)
        if corun_slowdown_per_rank is None:
            corun_slowdown_per_rank = corun_slowdown_from(runs)
        scaling = profile.scaling
        return cls(
            global_batch=profile.batch_size,
            forward=BatchCurve.fit([(s.batch_size, s.forward_s) for s in scaling]),
            backward=BatchCurve.fit([(s.batch_size, s.backward_s) for s in scaling]),
            optimizer=BatchCurve.fit([(s.batch_size, s.optimizer_s) for s in scaling]),
            buckets=buckets_of(profile, runs),
            intra_node=intra_node or DEFAULT_INTRA_NODE[kind],
            inter_node=inter_node or DEFAULT_INTER_NODE,
            bucket_overhead_s=DEFAULT_BUCKET_OVERHEAD_S[kind] if bucket_overhead_s is None else bucket_overhead_s,
            overlap_efficiency=DEFAULT_OVERLAP_EFFICIENCY[kind] if overlap_efficiency is None else overlap_efficiency,
            corun_slowdown_per_rank=corun_slowdown_per_rank or 0.0,
            memory_bytes_per_s=memory_bytes_per_s or DEFAULT_MEMORY_BYTES_PER_S[kind],
            straggler_fraction=straggler_fraction, straggler_world=straggler_world,
        )

    def breakdown(self, devices: int, nodes: int = 1) -> StepTimeBreakdown:
        if devices < 1 or nodes < 1 or nodes > devices:
            raise ValueError(f"need 1 <= nodes <= devices, got devices={devices}, nodes={nodes}")
        batch = math.ceil(self.global_batch / devices)
        slowdown = 1 + self.corun_slowdown_per_rank * (math.ceil(devices / nodes) - 1)
        backward = self.backward(batch) * slowdown
        link = self.intra_node if nodes == 1 else LinkParams.slower(self.intra_node, self.inter_node)
        comm_free, total_comm = 0.0, 0.0
        for bucket in self.buckets:  # all-reduces run one at a time, in bucket order
            cost = link.allreduce_s(bucket.bytes, devices)
            comm_free = max(comm_free, bucket.ready_fraction * backward) + cost
            total_comm += cost
        exposed_if_hidden = max(0.0, comm_free - backward)  # what sticks out even with perfect overlap
        exposed = total_comm - self.overlap_efficiency * (total_comm - exposed_if_hidden)
        forward, optimizer = self.forward(batch) * slowdown, self.optimizer(batch) * slowdown
        return StepTimeBreakdown(
            devices=devices, nodes=nodes, per_device_batch=batch,
            forward_s=forward, backward_s=backward, optimizer_s=optimizer,
            allreduce_s=total_comm, exposed_allreduce_s=exposed, overhead_s=self.ddp_overhead_s,
            straggler_s=self._straggler_s(devices, forward + backward + optimizer),
        )

    def _straggler_s(self, devices: int, compute_s: float) -> float:
        """The slowest of n ranks lags the typical one like the maximum of n samples of the
        same noise does: in proportion to sqrt(ln n)."""
        if devices == 1 or self.straggler_world < 2:
            return 0.0
        return self.straggler_fraction * compute_s * math.sqrt(math.log(devices) / math.log(self.straggler_world))

    @property
    def ddp_overhead_s(self) -> float:
        """DDP's cost per step at any size: a dispatch per bucket, and copying each gradient
        into its bucket and back (4 bytes of traffic per gradient byte)."""
        gradient_bytes = sum(b.bytes for b in self.buckets)
        return self.bucket_overhead_s * len(self.buckets) + 4 * gradient_bytes / self.memory_bytes_per_s

    def step_time(self, devices: int, nodes: int = 1) -> float:
        return self.breakdown(devices, nodes).step_s
