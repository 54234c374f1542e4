"""Feeding a trainer: which samples each process trains on at each step, and how they reach the device.

The global sample order (training.data.SampleOrder) fixes the global batch of every step.
It is split into L logical ranks (the trial's logical width, fixed for its whole life),
and each physical process holds a contiguous range of them (`local_spans`); a logical
rank's share may be split again into micro-batches of at most `max_device_batch`. So the
samples a logical rank sees, and in which micro-batches, never depend on how many
processes there are.

Where a step's global batch starts is a `Phase`: steps from `phase.step` on each take
`phase.batch_size` samples from global position `phase.samples`. A reproducible trial has one
phase for its whole life (position = step x batch); a `goodput` trial starts a new phase
with a new batch whenever its size changes, so its data position is counted in samples.

Two feeds deliver a process's micro-batches in order:
- `DeviceFeed`: the whole dataset (a TensorDataset, or materialized when asked) lives on
  the device; a micro-batch is one gather there, with the epoch's permutation kept on the
  device too: no host work that grows with the batch, no host-to-device copy per step.
- `LoaderFeed`: any map-style dataset through a DataLoader (worker processes, pinned
  memory, prefetching) whose batch sampler walks the same order; on a GPU each batch is
  copied on a side stream while the step before it runs (`training.graphs.copied_ahead`).
  Each micro-batch is fetched under random streams seeded from (the trial's seed, the
  global position of its first sample) (`SeededFetch`), so a dataset that augments at random
  gives each micro-batch the same draws at any number of processes, in a loader worker or
  not, after any resize or resume.
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing
import multiprocessing.context
import os
import random
import select
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from training.data import SampleOrder, shard_bounds
from training.graphs import copied_ahead
from training.hashing import GAMMA, MIX1, mix64
from training.workload import WorkloadError, dataset_bytes, move, split_pair

DEVICE_BYTES_AUTO = 2 * 2**30  # `on_device: auto` keeps a TensorDataset on a GPU up to this size...
DEVICE_FRACTION_AUTO = 0.25  # ...and this share of the GPU's memory
EVAL_BATCH_MIN = 256  # evaluation batches: the training batch, or this many where it is smaller


@dataclass(frozen=True, slots=True)
class Phase:
    """Steps from `step` on train `batch_size` samples each, the first from global position `samples`."""

    step: int
    samples: int
    batch_size: int

    def position(self, step: int) -> int:
        """The global position of `step`'s first sample."""
        return self.samples + (step - self.step) * self.batch_size


@dataclass(frozen=True, slots=True)
class Span:
    """One micro-batch of a process: positions [start, stop) of the step's global batch."""

    logical_rank: int
    start: int
    stop: int
    first: bool  # the first micro-batch of its logical rank: that rank's RNG stream starts here

    @property
    def size(self) -> int:
        return self.stop - self.start


def local_spans(batch_size: int, logical_ranks: int, world_size: int, rank: int, max_device_batch: int | None) -> tuple[Span, ...]:
    """The micro-batches physical `rank` of `world_size` runs at every step, in order."""
    if not 1 <= world_size <= logical_ranks:
        raise ValueError(f"{world_size} processes for {logical_ranks} logical ranks: each process needs at least one")
    first, last = shard_bounds(logical_ranks, world_size, rank)
    spans = []
    for logical in range(first, last):
        start, stop = shard_bounds(batch_size, logical_ranks, logical)
        chunks = max(1, math.ceil((stop - start) / max_device_batch)) if max_device_batch else 1
        for c in range(chunks):
            lo, hi = shard_bounds(stop - start, chunks, c)
            spans.append(Span(logical, start + lo, start + hi, c == 0))
    return tuple(spans)


class DeviceFeed:
    """The whole training set on the device; each micro-batch is a gather by index there."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, order: SampleOrder, batch_size: int, device: torch.device):
        self.inputs, self.targets = inputs.to(device), targets.to(device)
        self.order, self.device = order, device
        self.phase = Phase(0, 0, batch_size)
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:  # once an epoch: the host draws it, the device keeps it
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            order = torch.from_numpy(self.order.permutation(epoch))
            if self.device.type == "cuda":  # a pageable copy waits for the device; a pinned one is queued
                order = order.pin_memory()
            self._perms[epoch] = order.to(self.device, non_blocking=True)
        return self._perms[epoch]

    def indices(self, step: int, span: Span) -> torch.Tensor:
        n = self.order.num_samples
        epoch, offset = divmod(self.phase.position(step) + span.start, n)
        if offset + span.size <= n:
            return self._perm(epoch)[offset:offset + span.size]
        parts, need = [], span.size
        while need:
            take = min(need, n - offset)
            parts.append(self._perm(epoch)[offset:offset + take])
            need, epoch, offset = need - take, epoch + 1, 0
        return torch.cat(parts)

    def batches(self, first_step: int, last_step: int, spans: tuple[Span, ...]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(first_step, last_step):
            for span in spans:
                index = self.indices(step, span)
                yield self.inputs[index], self.targets[index]

    def close(self) -> None:
        pass


class SpanSampler:
    """A DataLoader batch sampler: a process's micro-batches, step after step, each a list of
    (global position, dataset index) for `SeededFetch`."""

    def __init__(self, order: SampleOrder, phase: Phase, spans: tuple[Span, ...], first_step: int, last_step: int):
        self.order, self.phase, self.spans = order, phase, spans
        self.first_step, self.last_step = first_step, last_step

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for step in range(self.first_step, self.last_step):
            position = self.phase.position(step)
            batch = self.order.batch_at(position, self.phase.batch_size)
            for span in self.spans:
                yield [(position + span.start + k, int(i)) for k, i in enumerate(batch[span.start:span.stop])]

    def __len__(self) -> int:
        return (self.last_step - self.first_step) * len(self.spans)


def fetch_seed(seed: int, position: int) -> int:
    """The seed a micro-batch starting at global sample `position` is fetched under: a pure
    function of the two (SplitMix64, as the trainer's step streams, on another combination)."""
    return mix64(seed * MIX1 + position * GAMMA + 2) >> 1


@contextlib.contextmanager
def seeded_rngs(seed: int) -> Iterator[None]:
    """Python's, NumPy's and torch's CPU random streams (those augmentations draw from) seeded
    with `seed` inside. Torch's is put back as it was after: in the trainer's own process a
    fetch between two micro-batches does not move the step's streams (dropout). Python's and
    NumPy's are left as the fetch left them, a pure function of the micro-batch fetched, so
    the same in every run (saving and restoring NumPy's costs ~85 us, ten times the rest)."""
    torch_state = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed: it would reseed the GPU's streams too
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)


class SeededFetch(Dataset):
    """The trial's dataset, each micro-batch (`SpanSampler`'s list of (position, index))
    fetched under `seeded_rngs(fetch_seed(seed, its first position))`. A dataset that augments
    at random (a crop, a flip, noise) then draws the same for a micro-batch whichever process
    fetches it and whenever: a loader worker's own seed (drawn per iterator), the trainer's
    step streams and the number of processes no longer say what it draws, so a resize or a
    resume trains on exactly the samples the trial would have without one. The micro-batches
    themselves never depend on the number of processes (`local_spans`)."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        indices = [index for _, index in keys]
        with seeded_rngs(fetch_seed(self.seed, keys[0][0])):
            many = getattr(self.dataset, "__getitems__", None)  # a dataset's own batched fetch, if it has one
            return list(many(indices)) if many else [self.dataset[i] for i in indices]


def loader_options(device: torch.device, workers: int) -> dict[str, Any]:
    """How a DataLoader feeds `device`: on a GPU, batches land in pinned (page-locked)
    memory, so that their copy to the device (`move(..., non_blocking=True)`) is an
    asynchronous DMA the host does not wait for; workers prefetch 4 batches each, and are
    started from a fork server (see `worker_context`)."""
    options = {"num_workers": workers, "pin_memory": device.type == "cuda", "prefetch_factor": 4 if workers else None}
    if workers:
        options["multiprocessing_context"] = worker_context()
        options["worker_init_fn"] = functools.partial(exit_with, os.getpid())
    return options


@functools.cache
def worker_context() -> multiprocessing.context.BaseContext:
    """Loader workers come from a fork server, not a fork of the trainer: the trainer runs
    threads (the metrics sink, gloo, the lease fence), and a fork taken while one of them
    holds an interpreter lock deadlocks the child (seen: a worker stuck in
    PyOS_AfterFork_Child). The server imports torch once, so a worker starts in milliseconds."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "training.batches"])
    return context


def exit_with(trainer_pid: int, worker_id: int) -> None:
    """A loader worker's first act: end when the trainer that feeds it ends. A forked worker
    learns it from its parent's death; a fork server's worker has the server as its parent,
    which outlives a killed trainer (and the worker keeps the server alive): without this, a
    SIGKILLed trainer left both behind, holding memory, for good."""
    try:
        trainer = os.pidfd_open(trainer_pid)
    except ProcessLookupError:
        os._exit(0)

    def watch() -> None:
        select.select([trainer], [], [])  # readable once the trainer has exited
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-trainer", daemon=True).start()


class LoaderFeed:
    """Any map-style dataset through a DataLoader walking the global order."""

    def __init__(self, dataset: Dataset, order: SampleOrder, batch_size: int, device: torch.device, workers: int):
        self.dataset, self.order, self.device, self.workers = dataset, order, device, workers
        self.phase = Phase(0, 0, batch_size)
        self._iterator = None

    def batches(self, first_step: int, last_step: int, spans: tuple[Span, ...]) -> Iterator[tuple[Any, Any]]:
        loader = DataLoader(
            SeededFetch(self.dataset, self.order.seed), batch_sampler=SpanSampler(self.order, self.phase, spans, first_step, last_step),
            persistent_workers=False, **loader_options(self.device, self.workers),
            # The workers' base seed from a generator of the loader's own: a new iterator
            # (a resize, a resume) does not draw it from the trainer's streams.
            generator=torch.Generator().manual_seed(self.order.seed),
        )
        self._iterator = iter(loader)
        pairs = (split_pair(batch) for batch in self._iterator)
        if self.device.type == "cuda":  # each batch's copy overlaps the step before it (training.graphs)
            yield from copied_ahead(pairs, self.device)
            return
        for x, y in pairs:
            yield move(x, self.device, non_blocking=True), move(y, self.device, non_blocking=True)

    def close(self) -> None:
        """Stop the loader's worker processes (a trainer that stops early, for a resize)."""
        it, self._iterator = self._iterator, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


def materialize(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """A dataset's samples as two stacked tensors (inputs, targets)."""
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[0], dataset.tensors[1]
    x, y = split_pair(default_collate([dataset[i] for i in range(len(dataset))]))
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        raise WorkloadError("data.on_device: true needs samples whose input and target are tensors")
    return x, y


def keeps_on_device(dataset: Dataset, on_device: bool | str, device: torch.device) -> bool:
    """Whether the dataset is fed from device memory: always when asked; for `auto`, a
    TensorDataset of two tensors that is small enough (on the CPU: always, it is there already)."""
    if on_device is True or device.type != "cuda":
        return on_device is True or (on_device is not False and _two_tensors(dataset))
    return kept_on_device(dataset, on_device, torch.cuda.get_device_properties(device).total_memory) is not None


def kept_on_device(dataset: Dataset, on_device: bool | str, device_memory: int) -> int | None:
    """The bytes a GPU of `device_memory` bytes holds of `dataset` when the feed keeps it
    there, None when it does not (pure: the packer's estimate asks it before any trial runs)."""
    if on_device is False or (on_device == "auto" and not _two_tensors(dataset)):
        return None
    size = dataset_bytes(dataset)
    if size is None:  # on_device: true on another dataset: stacked, its bytes are its samples'
        x, y = materialize(dataset)
        size = x.numel() * x.element_size() + y.numel() * y.element_size()
    if on_device is True or size <= min(DEVICE_BYTES_AUTO, DEVICE_FRACTION_AUTO * device_memory):
        return size
    return None


def _two_tensors(dataset: Dataset) -> bool:
    return isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2


def make_feed(dataset: Dataset, order: SampleOrder, batch_size: int, device: torch.device,
              on_device: bool | str = "auto", workers: int = 0) -> DeviceFeed | LoaderFeed:
    if keeps_on_device(dataset, on_device, device):
        return DeviceFeed(*materialize(dataset), order, batch_size, device)
    return LoaderFeed(dataset, order, batch_size, device, workers)


def eval_batches(dataset: Dataset, batch_size: int, device: torch.device, on_device: bool | str = "auto",
                 workers: int = 0, cache: dict | None = None) -> Iterator[tuple[Any, Any]]:
    """The validation set in order, in batches; kept on the device between evaluations when it fits."""
    if keeps_on_device(dataset, on_device, device):
        if cache is not None and "val" in cache:
            x, y = cache["val"]
        else:
            x, y = (t.to(device) for t in materialize(dataset))
            if cache is not None:
                cache["val"] = (x, y)
        for start in range(0, len(y), batch_size):
            yield x[start:start + batch_size], y[start:start + batch_size]
        return
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, **loader_options(device, workers))
    for batch in loader:
        x, y = split_pair(batch)
        yield move(x, device, non_blocking=True), move(y, device, non_blocking=True)
