"""Place device requests on free devices: by memory, whole gangs, good links, low fragmentation.

Pure (no I/O): the campaign packs a handful of trials onto one box with it, the simulator and
bench/packing_bench.py replay thousands of tasks onto thousands of GPUs with the same code.

Rules every policy keeps:
- A device holds requests while their memory fits: `used + placed <= memory_bytes`. A request
  asking for a device's whole memory therefore takes it only when nothing else is on it; one
  for `WHOLE_DEVICE` takes any device whole, whatever its memory (claim_bytes).
- A request for n devices gets n distinct devices at once, or nothing.
- Gangs stay on one node; with `multi_node=True` one that no single node can hold right now
  may spread over the fewest nodes.
- Among nodes that can hold a gang, the best-connected devices win first (worst pairwise
  `Link`, then the sum of links): NVLink pairs before PCIe before cross-socket.

Then the policy decides. The default, "fgd", is the fragmentation gradient descent of Weng et
al., "Beware of Fragmentation", USENIX ATC'23: put each request where the expected free memory
that the workload's requests cannot use grows least. "best-fit", "first-fit" and "random-fit"
are baselines with the same interface. Ties fall to inventory order, so the result is
deterministic for the same input (random-fit: for the same seed).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from itertools import combinations
from typing import Literal, Mapping, Sequence

import numpy as np

from cluster.types import WHOLE_DEVICE, Device, Inventory, Link, Placement, Request, claim_bytes
from training.errors import CampaignError

Policy = Literal["fgd", "best-fit", "first-fit", "random-fit"]
POLICIES: tuple[Policy, ...] = ("fgd", "best-fit", "first-fit", "random-fit")

# A node with more d-subsets of free devices than this gets a greedy link-aware choice
# instead of trying every subset (8 GPUs never come near it; CPU nodes with many slots do).
_EXACT_SUBSETS = 2000
_NO_RANK = np.iinfo(np.int64).max


class PlacementError(CampaignError):
    """A request that no node can hold even with every device free, or a malformed one."""


@dataclass(frozen=True, slots=True)
class Demand:
    """One kind of request the workload brings, and how often (weights of any scale)."""

    devices: int
    memory_bytes: int
    weight: float


def workload_of(requests: Sequence[Request]) -> tuple[Demand, ...]:
    """The kinds of request in `requests`, weighted by how often each occurs."""
    counts = Counter((r.devices, r.memory_bytes) for r in requests)
    return tuple(Demand(d, m, float(c)) for (d, m), c in sorted(counts.items()))


class _Fragmentation:
    """The ATC'23 fragmentation measure for one workload, vectorized over nodes.

    For a node and a kind of request m, the fragment is the free memory that m cannot use:
    all of it if the node lacks m.devices devices with m.memory_bytes free each, otherwise
    the free memory of the devices with less than m.memory_bytes free. A node's
    fragmentation is the weighted mean over the workload's kinds. A whole-device kind needs
    a device's capacity free: the device untouched.
    """

    def __init__(self, workload: Sequence[Demand]) -> None:
        kinds = [k for k in workload if k.weight > 0]
        self.mem = np.array([k.memory_bytes for k in kinds], dtype=np.int64)
        self.whole = self.mem == WHOLE_DEVICE
        self.need = np.array([k.devices for k in kinds], dtype=np.int64)
        weights = np.array([k.weight for k in kinds], dtype=np.float64)
        self.p = weights / weights.sum() if kinds else weights

    def need_bytes(self, cap: np.ndarray) -> np.ndarray:
        """The bytes each kind needs free on devices of capacity `cap` (any shape): (..., C), or
        (C,) when no kind is for whole devices (numpy broadcasts it)."""
        return np.where(self.whole, cap[..., None], self.mem) if self.whole.any() else self.mem

    def stats(self, free: np.ndarray, cap: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per node row of `free` and `cap` (k, G; absent devices: free -1, cap 0): S, K (k, C)
        and T (k,).

        S: free memory on devices too small for each kind; K: devices big enough; T: free.
        """
        fits = free[:, :, None] >= self.need_bytes(cap)
        held = np.maximum(free, 0)
        small = np.where(fits, 0, held[:, :, None]).sum(axis=1)
        return small, fits.sum(axis=1), held.sum(axis=1)

    def frag(self, small: np.ndarray, big: np.ndarray, total: np.ndarray) -> np.ndarray:
        lacking = big < self.need
        return (np.where(lacking, total[..., None], small) * self.p).sum(axis=-1)

    def after_one(
        self, free: np.ndarray, cap: np.ndarray, small: np.ndarray, big: np.ndarray, total: np.ndarray,
        taken: np.ndarray,
    ) -> np.ndarray:
        """Fragmentation of each slot's node after `taken[i, j]` more is taken from slot j.

        free, cap (j,), small/big (j, C), total (j,) describe each slot and its node; `taken`
        and the result are (R, j) for R requests. Only one device changes, so S and K are
        patched rather than recomputed over the whole node.
        """
        left = free[None, :] - taken
        need = self.need_bytes(cap)  # (j, C)
        fit_before = free[:, None] >= need
        fit_after = left[:, :, None] >= need
        big2 = big - fit_before + fit_after
        small2 = (small - np.where(fit_before, 0, free[:, None])
                  + np.where(fit_after, 0, np.maximum(left, 0)[:, :, None]))
        return self.frag(small2, big2, total[None, :] - taken)


class Packer:
    """Free memory per device of an inventory, placing one request at a time.

    `used`: bytes already leased per device id (ids not in the inventory are ignored).
    `workload`: the kinds of request expected, which fgd keeps room for and
    `fragmentation()` measures against; without one, every kind placed so far counts equally.
    """

    def __init__(
        self,
        inventory: Inventory,
        used: Mapping[str, int] | None = None,
        *,
        policy: Policy = "fgd",
        workload: Sequence[Demand] | None = None,
        multi_node: bool = False,
        seed: int = 0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown packing policy {policy!r}; choose one of {POLICIES}")
        self.policy = policy
        self.multi_node = multi_node
        self._rng = np.random.default_rng(seed)
        self._index(inventory)
        used = used or {}
        # An extra last entry stands for "no device" in the padded node matrix.
        self._free_ext = np.append(
            np.maximum(self._cap - [used.get(d.id, 0) for d in self._devices], 0), -1
        ).astype(np.int64)
        self._free = self._free_ext[:-1]
        self._learn = workload is None
        self._kinds: Counter[tuple[int, int]] = Counter()
        for k in workload or ():
            self._kinds[k.devices, k.memory_bytes] += k.weight
        self._set_workload()

    # -- public -------------------------------------------------------------------------

    def place(self, request: Request) -> Placement | None:
        """Place `request` now and return where, or None if it does not fit now."""
        _validate(request)
        kind = (request.devices, request.memory_bytes)
        if self._learn and kind not in self._kinds:
            self._kinds[kind] = 1.0
            self._set_workload()
        mem, count = request.memory_bytes, request.devices
        if count > len(self._devices):
            return None
        feasible = self._free >= self._need(mem)
        if self.policy == "random-fit":
            self._node_draw = self._rng.random(len(self._node_slots))
            self._slot_draw = self._rng.random(len(self._devices))
        if count == 1:
            best = _lexargmin(self._slot_keys(mem, feasible))
            slots = None if best < 0 else [best]
        else:
            slots = self._gang(mem, count, feasible)
        if slots is None:
            return None
        self._take(np.array(slots), mem)
        return Placement(request.trial_id, tuple(self._devices[s].id for s in slots), mem)

    def release(self, placement: Placement) -> None:
        """Give back what `placement` took (a trial ended or shrank)."""
        slots = np.array([self._slot_of[i] for i in placement.device_ids], dtype=np.int64)
        self._free[slots] += self._need(placement.memory_bytes, slots)
        assert (self._free[slots] <= self._cap[slots]).all(), "released more than was taken"
        self._refresh(np.unique(self._slot_node[slots]))

    def free_bytes(self, device_id: str) -> int:
        return int(self._free[self._slot_of[device_id]])

    @property
    def capacity_bytes(self) -> int:
        return int(self._cap.sum())

    @property
    def free_total_bytes(self) -> int:
        return int(self._free.sum())

    def fragmentation(self) -> float:
        """Expected free bytes the workload's requests cannot use (ATC'23), summed over nodes."""
        return float(self._node_frag.sum())

    # -- set-up -------------------------------------------------------------------------

    def _index(self, inventory: Inventory) -> None:
        """Lay devices out node by node so a node's devices are contiguous slots."""
        nodes = inventory.nodes
        members: dict[str, list] = {n: [] for n in nodes}
        for d in inventory.devices:
            members[d.node].append(d)
        self._devices = tuple(
            d for n in nodes for d in sorted(members[n], key=lambda d: (d.index, d.id))
        )
        self._slot_of = {d.id: s for s, d in enumerate(self._devices)}
        self._cap = np.array([d.memory_bytes for d in self._devices], dtype=np.int64)
        self._cap_ext = np.append(self._cap, 0)  # the padded node matrix's "no device" holds nothing
        node_of = {n: i for i, n in enumerate(nodes)}
        self._slot_node = np.array([node_of[d.node] for d in self._devices], dtype=np.int64)
        width = max((len(m) for m in members.values()), default=1)
        self._node_slots = np.full((len(nodes), width), len(self._devices), dtype=np.int64)
        first = 0
        for i, n in enumerate(nodes):
            self._node_slots[i, : len(members[n])] = range(first, first + len(members[n]))
            first += len(members[n])
        self._index_links(inventory, [len(members[n]) for n in nodes])

    def _index_links(self, inventory: Inventory, sizes: list[int]) -> None:
        """Per node, one link kind for all pairs, or the matrix where pairs differ."""
        mats = [np.full((g, g), int(Link.PCIE_HOST), dtype=np.int64) for g in sizes]
        for pair, link in inventory.links.items():
            if len(pair) != 2:
                continue
            a, b = (self._slot_of.get(i) for i in pair)
            if a is None or b is None or self._slot_node[a] != self._slot_node[b]:
                continue
            node = self._slot_node[a]
            la, lb = a - self._node_slots[node, 0], b - self._node_slots[node, 0]
            mats[node][la, lb] = mats[node][lb, la] = int(link)
        self._uniform_link = np.zeros(len(sizes), dtype=np.int64)
        self._link_matrix: dict[int, list[list[int]]] = {}
        for node, mat in enumerate(mats):
            pairs = mat[~np.eye(len(mat), dtype=bool)]
            if pairs.size and (pairs != pairs[0]).any():
                self._link_matrix[node] = mat.tolist()
            else:
                self._uniform_link[node] = pairs[0] if pairs.size else int(Link.SAME)

    def _set_workload(self) -> None:
        self._model = _Fragmentation(
            [Demand(d, m, w) for (d, m), w in sorted(self._kinds.items())]
        )
        n_nodes = len(self._node_slots)
        c = len(self._model.mem)
        self._small = np.zeros((n_nodes, c), dtype=np.int64)
        self._big = np.zeros((n_nodes, c), dtype=np.int64)
        self._total = np.zeros(n_nodes, dtype=np.int64)
        self._node_frag = np.zeros(n_nodes, dtype=np.float64)
        # fgd's cached cost of putting each size on each slot: one row per size seen.
        self._row_of: dict[int, int] = {}
        self._rows = np.zeros((0, len(self._devices)), dtype=np.float64)
        # Link-aware gangs per (node, size, count), valid while the node's version holds.
        self._version = np.zeros(n_nodes, dtype=np.int64)
        self._groups: dict[tuple[int, int, int], tuple[int, tuple[list[int], int, int]]] = {}
        self._refresh(np.arange(n_nodes))

    # -- bookkeeping --------------------------------------------------------------------

    def _need(self, mem: int, slots: np.ndarray | None = None) -> int | np.ndarray:
        """The bytes a request of `mem` per device takes of each slot, or of `slots` (claim_bytes):
        `mem` itself (a number, which numpy broadcasts) but for a whole-device request."""
        if mem != WHOLE_DEVICE:
            return mem
        return self._cap if slots is None else self._cap[slots]

    def _take(self, slots: np.ndarray, mem: int) -> None:
        need = self._need(mem, slots)
        assert (self._free[slots] >= need).all(), "placing where memory does not fit"
        self._free[slots] -= need
        self._refresh(np.unique(self._slot_node[slots]))

    def _refresh(self, nodes: np.ndarray) -> None:
        """Recompute the fragmentation state of `nodes` after their free memory changed."""
        slots = self._node_slots[nodes]
        small, big, total = self._model.stats(self._free_ext[slots], self._cap_ext[slots])
        self._small[nodes], self._big[nodes], self._total[nodes] = small, big, total
        self._node_frag[nodes] = self._model.frag(small, big, total)
        self._version[nodes] += 1
        if self._row_of:
            slots = self._node_slots[nodes].ravel()
            slots = slots[slots < len(self._devices)]
            self._rows[:, slots] = self._one_slot_costs(slots, self._row_mems)

    def _one_slot_costs(self, slots: np.ndarray, mems: np.ndarray) -> np.ndarray:
        """Growth of fragmentation from putting each of `mems` on each of `slots` (R, j)."""
        node = self._slot_node[slots]
        free, cap = self._free[slots], self._cap[slots]
        taken = np.where(mems[:, None] == WHOLE_DEVICE, cap[None, :], mems[:, None])
        after = self._model.after_one(
            free, cap, self._small[node], self._big[node], self._total[node], taken
        )
        cost = after - self._node_frag[node][None, :]
        cost[free[None, :] < taken] = np.inf
        return cost

    def _fgd_row(self, mem: int) -> np.ndarray:
        row = self._row_of.get(mem)
        if row is None:
            row = self._row_of[mem] = len(self._rows)
            self._row_mems = np.array(list(self._row_of), dtype=np.int64)
            every = np.arange(len(self._devices))
            new = self._one_slot_costs(every, np.array([mem], dtype=np.int64))
            self._rows = np.vstack([self._rows, new])
        return self._rows[row]

    # -- choosing -----------------------------------------------------------------------

    def _slot_keys(self, mem: int, feasible: np.ndarray) -> list[np.ndarray]:
        """Lexicographic keys per slot, lower is better; +inf in the first where it cannot fit."""
        node = self._slot_node
        need = self._need(mem)
        free_after = (self._free - need).astype(np.float64)
        node_after = np.where(feasible, (self._total[node] - need).astype(np.float64), np.inf)
        if self.policy == "fgd":
            return [self._fgd_row(mem), node_after, free_after]
        if self.policy == "best-fit":
            return [node_after, free_after]
        if self.policy == "first-fit":
            return [np.where(feasible, 0.0, np.inf)]
        return [np.where(feasible, self._node_draw[node], np.inf), self._slot_draw]

    def _gang(self, mem: int, count: int, feasible: np.ndarray) -> list[int] | None:
        """Slots for a gang of `count` on one node (or the fewest nodes), or None."""
        keys = self._slot_keys(mem, feasible)
        rank = np.empty(len(self._devices), dtype=np.int64)
        rank[np.lexsort(keys[::-1])] = np.arange(len(self._devices))
        rank_ext = np.append(np.where(feasible, rank, _NO_RANK), _NO_RANK)
        ranks = rank_ext[self._node_slots]  # (nodes, width), _NO_RANK where absent or full
        open_ = (ranks != _NO_RANK).sum(axis=1)
        cand = np.flatnonzero(open_ >= count)
        if cand.size == 0:
            return self._spread(count, ranks, open_) if self.multi_node else None
        best_pos = np.argsort(ranks[cand], axis=1, kind="stable")[:, :count]
        chosen = np.take_along_axis(self._node_slots[cand], best_pos, axis=1)
        worst = self._uniform_link[cand].copy()
        link_sum = worst * (count * (count - 1) // 2)
        for i, node in enumerate(cand):
            if node in self._link_matrix:
                chosen[i], worst[i], link_sum[i] = self._connected(node, ranks[node], mem, count)
        first, second = self._gang_scores(cand, chosen, mem, count)
        pick = _lexargmin([worst.astype(np.float64), link_sum.astype(np.float64), first, second])
        return sorted(chosen[pick].tolist())

    def _gang_scores(
        self, cand: np.ndarray, chosen: np.ndarray, mem: int, count: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The policy's two keys for putting the gang on each candidate node's chosen slots."""
        need = np.broadcast_to(self._need(mem, chosen), chosen.shape)  # (candidates, count)
        left = (self._total[cand] - need.sum(axis=1)).astype(np.float64)
        if self.policy == "fgd":
            free = self._free_ext[self._node_slots[cand]]
            pos = chosen - self._node_slots[cand, :1]
            np.put_along_axis(free, pos, np.take_along_axis(free, pos, axis=1) - need, axis=1)
            after = self._model.frag(*self._model.stats(free, self._cap_ext[self._node_slots[cand]]))
            return after - self._node_frag[cand], left
        if self.policy == "best-fit":
            return left, (self._free[chosen] - need).sum(axis=1).astype(np.float64)
        if self.policy == "first-fit":
            return cand.astype(np.float64), np.zeros(len(cand))
        return self._node_draw[cand], np.zeros(len(cand))

    def _connected(
        self, node: int, ranks: np.ndarray, mem: int, count: int
    ) -> tuple[list[int], int, int]:
        """`_best_connected`, remembered until the node changes.

        The order of a node's devices under every policy but random-fit depends on that
        node's state alone, so a big simulated cluster pays for the nodes that changed only.
        """
        if self.policy == "random-fit":
            return self._best_connected(node, ranks, count)
        version, found = self._groups.get((node, mem, count), (-1, None))
        if version != self._version[node]:
            found = self._best_connected(node, ranks, count)
            self._groups[node, mem, count] = (int(self._version[node]), found)
        return found

    def _best_connected(
        self, node: int, ranks: np.ndarray, count: int
    ) -> tuple[list[int], int, int]:
        """The `count` open devices of `node` with the best links, then the policy's order."""
        links = self._link_matrix[node]
        open_pos = [int(p) for p in np.argsort(ranks, kind="stable") if ranks[p] != _NO_RANK]
        preference = {p: i for i, p in enumerate(open_pos)}

        def key(group: Sequence[int]) -> tuple[int, int, int]:
            pairs = [links[a][b] for a, b in combinations(group, 2)]
            return max(pairs), sum(pairs), sum(preference[p] for p in group)

        if math.comb(len(open_pos), count) <= _EXACT_SUBSETS:
            groups: list[Sequence[int]] = list(combinations(open_pos, count))
        else:
            groups = [_grow(seed, open_pos, count, links) for seed in open_pos]
        best = min(groups, key=key)
        worst, total, _ = key(best)
        base = int(self._node_slots[node, 0])
        return [base + p for p in best], worst, total

    def _spread(self, count: int, ranks: np.ndarray, open_: np.ndarray) -> list[int] | None:
        """Fewest nodes: those with the most open devices first, best-ranked devices in each.

        Links inside each node are not weighed here: across nodes the network is the bottleneck.
        """
        if open_.sum() < count:
            return None
        slots: list[int] = []
        for node in np.lexsort((np.arange(len(open_)), -open_)):
            take = min(count - len(slots), int(open_[node]))
            pos = np.argsort(ranks[node], kind="stable")[:take]
            slots.extend(int(s) for s in self._node_slots[node, pos])
            if len(slots) == count:
                return slots
        return None


def _grow(seed: int, open_pos: list[int], count: int, links: list[list[int]]) -> list[int]:
    """Greedy gang from `seed`: add the device whose worst and total link to the group is least."""
    group = [seed]
    rest = [p for p in open_pos if p != seed]  # already in rank order: ties go to better ranks
    while len(group) < count:
        nxt = min(rest, key=lambda p: (max(links[p][g] for g in group),
                                       sum(links[p][g] for g in group)))
        group.append(nxt)
        rest.remove(nxt)
    return group


def _lexargmin(keys: list[np.ndarray]) -> int:
    """Index of the lexicographically least row of `keys`, first on ties; -1 if none finite."""
    idx = np.flatnonzero(np.isfinite(keys[0]))
    for key in keys:
        if idx.size <= 1:
            break
        values = key[idx]
        least = values.min()
        # Equal costs computed along different paths may differ in the last bits.
        idx = idx[values <= least + 1e-9 * max(1.0, abs(least))]
    return int(idx[0]) if idx.size else -1


def _validate(request: Request) -> None:
    # Zero memory would let a trial slip onto a device another trial holds exclusively.
    if request.devices < 1 or request.memory_bytes < 1:
        raise PlacementError(
            f"trial {request.trial_id!r} asks for {request.devices} device(s) with "
            f"{request.memory_bytes} bytes each; it needs at least 1 device and 1 byte"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_fits(
    requests: Sequence[Request], inventory: Inventory, *, multi_node: bool = False
) -> None:
    """Raise PlacementError for the first request no node could hold even when all are free."""
    caps: dict[str, list[int]] = {}
    for d in inventory.devices:
        caps.setdefault(d.node, []).append(d.memory_bytes)
    for req in requests:
        _validate(req)
        room = [sum(req.whole or c >= req.memory_bytes for c in node) for node in caps.values()]
        fits = (sum(room) if multi_node else max(room, default=0)) >= req.devices
        if fits:
            continue
        if not caps:
            raise PlacementError(f"trial {req.trial_id!r} needs {req.devices} device(s), and the inventory has none")
        name, node = max(caps.items(), key=lambda kv: (len(kv[1]), max(kv[1])))
        count = len(inventory.devices) if multi_node else len(node)
        if count < req.devices:  # too many devices, whatever their memory
            where = "the whole cluster has" if multi_node else f"the largest node, {name!r}, has"
            raise PlacementError(
                f"trial {req.trial_id!r} needs {req.devices} devices; {where} {count} "
                f"({inventory.kind} device{'s' if count != 1 else ''}). Set resources.devices to at most {count} "
                f"(or a range such as [1, {req.devices}]); training.logical_ranks: {req.devices} keeps the results of "
                f"{req.devices} processes on fewer devices."
            )
        best, best_node = max(caps.items(), key=lambda kv: (sum(c >= req.memory_bytes for c in kv[1]), max(kv[1])))
        enough = sum(room) if multi_node else max(room, default=0)
        raise PlacementError(
            f"trial {req.trial_id!r} needs {req.devices} device(s) with {_gib(req.memory_bytes)} free each; "
            f"{'the cluster has' if multi_node else 'one node has at most'} {enough} with that much "
            f"({best!r}: {len(best_node)} device(s) of up to {_gib(max(best_node))}). "
            "Ask for less memory per device (resources.memory_gb, a smaller batch or model) or fewer devices."
        )


def pack(
    requests: Sequence[Request],
    inventory: Inventory,
    used: Mapping[str, int] | None = None,
    *,
    policy: Policy = "fgd",
    multi_node: bool = False,
    seed: int = 0,
) -> list[Placement]:
    """Place `requests` in the given order; those that do not fit now are left out.

    `used`: bytes already leased per device id. The requests themselves are the workload
    that fgd keeps room for.
    """
    packer = Packer(
        inventory, used, policy=policy, workload=workload_of(requests),
        multi_node=multi_node, seed=seed,
    )
    return [p for r in requests if (p := packer.place(r)) is not None]


def resize_devices(
    inventory: Inventory, current: Sequence[str], target: int, memory_bytes: int, used: Mapping[str, int],
    spread: bool = False,
) -> tuple[str, ...] | None:
    """The devices a running trial goes on with at `target` devices, or None if too few are free.

    Shrinking keeps a prefix of `current`: rank 0 and the first ranks stay, so the state
    stays in memory. Growing keeps all of `current` and adds free devices of the same node,
    best linked to the current ones first; with `spread` (a pool's trial, which may span
    nodes), what its node lacks comes from the other nodes, those with the most free
    devices first, so that it spans as few as it can. `used` counts leased bytes, the
    trial's own too.
    """
    if target <= len(current):
        return tuple(current[:target])
    node = inventory.device(current[0]).node
    free = [d for d in inventory.devices
            if d.id not in current and used.get(d.id, 0) + claim_bytes(memory_bytes, d.memory_bytes) <= d.memory_bytes]
    candidates = [d for d in free if d.node == node]
    candidates.sort(key=lambda d: (max(inventory.link(d.id, c) for c in current), sum(inventory.link(d.id, c) for c in current), d.index))
    if spread:
        spanned = {inventory.device(c).node for c in current}
        per_node: dict[str, list[Device]] = {}
        for d in free:
            if d.node != node:
                per_node.setdefault(d.node, []).append(d)
        # Nodes it already spans first, then the fullest: the fewer nodes, the less it crosses the network.
        for other in sorted(per_node, key=lambda n: (n not in spanned, -len(per_node[n]), n)):
            candidates += sorted(per_node[other], key=lambda d: d.index)
    missing = target - len(current)
    if len(candidates) < missing:
        return None
    return tuple(current) + tuple(d.id for d in candidates[:missing])
