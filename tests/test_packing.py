"""Properties of cluster/packing.py over random inventories, requests and leases.

Each property is checked against a plain-Python replay of the free memory, independent of
the packer's numpy bookkeeping. Nodes differ in their devices' memory, and requests for
whole devices (WHOLE_DEVICE) take any device whole, whatever its memory.
"""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cluster.packing import (
    POLICIES, Demand, Packer, PlacementError, check_fits, pack, resize_devices, workload_of,
)
from cluster.types import WHOLE_DEVICE, Device, Inventory, Link, Placement, Request

GIB = 2**30
SIZES = (8 * GIB, 16 * GIB, 24 * GIB)

settings.register_profile("packing", max_examples=120, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("packing")


@st.composite
def inventories(draw) -> Inventory:
    devices, links = [], {}
    for n in range(draw(st.integers(1, 4))):
        size = draw(st.sampled_from(SIZES))
        ids = [f"n{n}/gpu{i}" for i in range(draw(st.integers(1, 6)))]
        devices += [Device(d, f"n{n}", i, "gpu", "g", size) for i, d in enumerate(ids)]
        for a, b in combinations(ids, 2):
            if draw(st.booleans()):
                links[frozenset((a, b))] = draw(st.sampled_from(list(Link)[1:5]))
    return Inventory(tuple(devices), links)


@st.composite
def requests(draw, n_max: int = 14) -> list[Request]:
    out = []
    for i in range(draw(st.integers(1, n_max))):
        whole = draw(st.booleans())
        mem = draw(st.sampled_from((*SIZES, WHOLE_DEVICE))) if whole else draw(st.integers(1, 26 * GIB))
        out.append(Request(f"t{i}", draw(st.integers(1, 5)), mem))
    return out


@st.composite
def leases(draw, inventory: Inventory) -> dict[str, int]:
    shares = st.sampled_from([0, 1 / 3, 1 / 2, 1])
    return {d.id: int(d.memory_bytes * draw(shares))
            for d in inventory.devices if draw(st.booleans())}


def cases():
    return inventories().flatmap(
        lambda inv: st.tuples(st.just(inv), requests(), leases(inv), st.sampled_from(POLICIES),
                              st.booleans())
    )


def taken(memory_bytes: int, device: Device) -> int:
    """What a request of `memory_bytes` per device takes of `device`, written out."""
    return device.memory_bytes if memory_bytes == WHOLE_DEVICE else memory_bytes


def fits_now(req: Request, free: dict[str, int], inv: Inventory, multi_node: bool) -> bool:
    room = {n: 0 for n in inv.nodes}
    for d in inv.devices:
        room[d.node] += free[d.id] >= taken(req.memory_bytes, d)
    return (sum(room.values()) if multi_node else max(room.values())) >= req.devices


@given(cases())
def test_every_placement_is_whole_and_memory_is_never_overcommitted(case):
    inv, reqs, used, policy, multi_node = case
    placements = pack(reqs, inv, used, policy=policy, multi_node=multi_node)
    by_id = {r.trial_id: r for r in reqs}
    free = {d.id: d.memory_bytes - used.get(d.id, 0) for d in inv.devices}
    placed_ids = [p.trial_id for p in placements]
    assert placed_ids == [r.trial_id for r in reqs if r.trial_id in placed_ids]  # request order
    sharers: dict[str, list[Placement]] = {d.id: [] for d in inv.devices}
    for p in placements:
        req = by_id[p.trial_id]
        assert len(p.device_ids) == len(set(p.device_ids)) == req.devices
        assert p.memory_bytes == req.memory_bytes
        for dev in p.device_ids:
            free[dev] -= taken(p.memory_bytes, inv.device(dev))
            sharers[dev].append(p)
        if not multi_node:
            assert len({inv.device(d).node for d in p.device_ids}) == 1
    assert all(f >= 0 for f in free.values()), free
    for dev, ps in sharers.items():
        cap = inv.device(dev).memory_bytes
        if any(taken(p.memory_bytes, inv.device(dev)) >= cap for p in ps):  # exclusive: alone, on a device free of leases
            assert len(ps) == 1 and used.get(dev, 0) == 0


@given(cases())
def test_a_request_is_left_out_only_when_it_does_not_fit_at_its_turn(case):
    inv, reqs, used, policy, multi_node = case
    placed = {p.trial_id: p for p in pack(reqs, inv, used, policy=policy, multi_node=multi_node)}
    free = {d.id: d.memory_bytes - used.get(d.id, 0) for d in inv.devices}
    for req in reqs:
        assert (req.trial_id in placed) == fits_now(req, free, inv, multi_node), req
        for dev in placed[req.trial_id].device_ids if req.trial_id in placed else ():
            free[dev] -= taken(req.memory_bytes, inv.device(dev))


@given(cases(), st.integers(0, 3))
def test_same_input_gives_the_same_placements(case, seed):
    inv, reqs, used, policy, multi_node = case
    first = pack(reqs, inv, used, policy=policy, multi_node=multi_node, seed=seed)
    assert pack(reqs, inv, dict(used), policy=policy, multi_node=multi_node, seed=seed) == first


@given(inventories().flatmap(lambda inv: st.tuples(st.just(inv), leases(inv))),
       st.integers(2, 5), st.sampled_from([GIB, 8 * GIB, 16 * GIB]), st.sampled_from(POLICIES))
def test_a_gang_stays_on_one_node_whenever_one_node_can_hold_it(inv_used, count, mem, policy):
    inv, used = inv_used
    free = {d.id: d.memory_bytes - used.get(d.id, 0) for d in inv.devices}
    req = Request("gang", count, mem)
    got = pack([req], inv, used, policy=policy, multi_node=True)
    if fits_now(req, free, inv, multi_node=False):
        assert len({inv.device(d).node for d in got[0].device_ids}) == 1
    else:
        assert bool(got) == fits_now(req, free, inv, multi_node=True)


def measured(inv: Inventory, free: dict[str, int], workload: list[Demand]) -> float:
    """The ATC'23 measure, written out: free memory each kind cannot use, weighted."""
    total, weights = 0.0, sum(k.weight for k in workload)
    for node in inv.nodes:
        devices = [d for d in inv.devices if d.node == node]
        left = [free[d.id] for d in devices]
        for kind in workload:
            usable = [free[d.id] for d in devices if free[d.id] >= taken(kind.memory_bytes, d)]
            lost = sum(left) if len(usable) < kind.devices else sum(left) - sum(usable)
            total += kind.weight * lost / weights
    return total


@given(inventories(), requests(n_max=10))
def test_fgd_puts_each_single_device_request_where_fragmentation_grows_least(inv, reqs):
    workload = list(workload_of(reqs))
    packer = Packer(inv, workload=workload)
    free = {d.id: d.memory_bytes for d in inv.devices}
    for req in reqs:
        placement = packer.place(req)
        if placement is None or req.devices > 1:
            for dev in placement.device_ids if placement else ():
                free[dev] -= taken(req.memory_bytes, inv.device(dev))
            continue
        after = {}
        for dev in (d for d in free if free[d] >= taken(req.memory_bytes, inv.device(d))):
            free[dev] -= taken(req.memory_bytes, inv.device(dev))
            after[dev] = measured(inv, free, workload)
            free[dev] += taken(req.memory_bytes, inv.device(dev))
        (chosen,) = placement.device_ids
        assert after[chosen] == pytest.approx(min(after.values()), rel=1e-9, abs=1e-3)
        free[chosen] -= taken(req.memory_bytes, inv.device(chosen))


@given(st.lists(st.lists(st.sampled_from([0, 300, 500, 1000]), min_size=1, max_size=6),
                min_size=1, max_size=5),
       st.lists(st.tuples(st.integers(1, 4), st.sampled_from([200, 500, 1000])), min_size=1),
       st.integers(2, 4))
# Best-fit would take the fuller second node and leave it no pair for the next gang.
@example(nodes=[[0, 0, 0, 0], [0, 0, 0, 500]], kinds=[(2, 1000)], count=2)
def test_fgd_puts_a_whole_device_gang_on_the_node_where_fragmentation_grows_least(
    nodes, kinds, count
):
    # Devices of 1000 with no link data: any `count` free devices of a node are alike, so
    # the node choice alone decides the outcome.
    inv = Inventory(tuple(Device(f"n{n}/gpu{i}", f"n{n}", i, "gpu", "g", 1000)
                          for n, node in enumerate(nodes) for i in range(len(node))))
    used = {f"n{n}/gpu{i}": u for n, node in enumerate(nodes) for i, u in enumerate(node)}
    workload = [Demand(d, m, 1.0) for d, m in kinds]
    free = {d: 1000 - u for d, u in used.items()}
    placement = Packer(inv, used, workload=workload).place(Request("gang", count, 1000))
    after = {}
    for node in inv.nodes:
        empty = [d.id for d in inv.devices if d.node == node and free[d.id] == 1000]
        if len(empty) >= count:
            after[node] = measured(inv, {**free, **{d: 0 for d in empty[:count]}}, workload)
    if not after:
        assert placement is None
        return
    chosen = {inv.device(d).node for d in placement.device_ids}
    assert len(chosen) == 1
    assert after[chosen.pop()] == pytest.approx(min(after.values()), rel=1e-9, abs=1e-6)


def free_after(inv: Inventory, placements: list[Placement]) -> dict[str, int]:
    free = {d.id: d.memory_bytes for d in inv.devices}
    for p in placements:
        for dev in p.device_ids:
            free[dev] -= taken(p.memory_bytes, inv.device(dev))
    return free


@given(inventories(), requests(n_max=10), st.sampled_from(POLICIES))
def test_fragmentation_matches_the_measure_recomputed_from_free_memory(inv, reqs, policy):
    packer = Packer(inv, policy=policy, workload=workload_of(reqs))
    placements = [p for r in reqs if (p := packer.place(r))]
    if placements:  # releasing must restore the bookkeeping as well
        packer.release(placements.pop(0))
    free = free_after(inv, placements)
    assert all(packer.free_bytes(d) == f for d, f in free.items())
    assert packer.fragmentation() == pytest.approx(measured(inv, free, list(workload_of(reqs))),
                                                   rel=1e-9, abs=1e-3)
    # Without a workload, every kind placed so far counts once.
    learner = Packer(inv, policy=policy)
    placements = [p for r in reqs if (p := learner.place(r))]
    kinds = [Demand(d, m, 1.0) for d, m in {(r.devices, r.memory_bytes) for r in reqs}]
    assert learner.fragmentation() == pytest.approx(
        measured(inv, free_after(inv, placements), kinds), rel=1e-9, abs=1e-3)


def one_node(size: int, count: int, links=None, name: str = "box") -> Inventory:
    devs = tuple(Device(f"{name}/gpu{i}", name, i, "gpu", "g", size) for i in range(count))
    return Inventory(devs, links or {})


def dgx_like() -> Inventory:
    """8 GPUs: NVLink pairs (0,1) (2,3) (4,5) (6,7); 0-3 and 4-7 on two sockets."""
    links = {}
    for a, b in combinations(range(8), 2):
        kind = (Link.NVLINK if a // 2 == b // 2 else
                Link.PCIE_HOST if a // 4 == b // 4 else Link.CROSS_SOCKET)
        links[frozenset((f"box/gpu{a}", f"box/gpu{b}"))] = kind
    return one_node(16 * GIB, 8, links)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pair_goes_to_an_nvlink_pair_and_four_stay_on_one_socket(policy):
    inv = dgx_like()
    # GPUs 0 and 2 are taken: 1 and 3 are free but only PCIe-connected; 4-7 hold two pairs.
    used = {"box/gpu0": 16 * GIB, "box/gpu2": 16 * GIB}
    pair = pack([Request("pair", 2, 16 * GIB)], inv, used, policy=policy)[0]
    a, b = (int(d[-1]) for d in pair.device_ids)
    assert inv.link(*pair.device_ids) == Link.NVLINK and a // 2 == b // 2
    four = pack([Request("four", 4, 16 * GIB)], inv, policy=policy)[0]
    assert len({int(d[-1]) // 4 for d in four.device_ids}) == 1  # never across sockets


def test_requests_of_sixty_percent_memory_never_share_a_gpu():
    inv = one_node(10 * GIB, 2)
    sixty = [Request(f"t{i}", 1, 6 * GIB) for i in range(3)]
    placements = pack(sixty, inv)
    assert [p.trial_id for p in placements] == ["t0", "t1"]
    assert placements[0].device_ids != placements[1].device_ids


def test_fgd_keeps_room_for_the_common_size_where_best_fit_does_not():
    inv = Inventory((Device("a/gpu0", "a", 0, "gpu", "g", 1000),
                     Device("b/gpu0", "b", 0, "gpu", "g", 1000)))
    used = {"a/gpu0": 400, "b/gpu0": 500}  # 600 and 500 free
    workload = [Demand(1, 500, 1.0), Demand(1, 100, 1.0)]
    small = Request("small", 1, 100)
    fgd = Packer(inv, used, workload=workload).place(small)
    best = Packer(inv, used, policy="best-fit", workload=workload).place(small)
    assert best.device_ids == ("b/gpu0",)  # tightest fit: 400 left on b, too small for 500
    assert fgd.device_ids == ("a/gpu0",)  # 500 left on both: a 500 still fits


def test_check_fits_names_the_trial_and_what_the_largest_node_offers():
    inv = Inventory(one_node(8 * GIB, 2, name="small").devices + one_node(16 * GIB, 4).devices)
    check_fits([Request("ok", 4, 16 * GIB)], inv)
    with pytest.raises(PlacementError, match=r"'wide' needs 5 devices; the largest node, 'box', has 4 \(gpu devices\)"):
        check_fits([Request("ok", 1, GIB), Request("wide", 5, GIB)], inv)
    # Enough devices but not enough memory on them: the message speaks of memory, not count.
    with pytest.raises(PlacementError, match=r"'big' needs 3 device\(s\) with 10\.0 GiB free each; one node has at most 2 with that much \('x': 2 device\(s\) of up to 16\.0 GiB\)"):
        check_fits([Request("big", 3, 10 * GIB)], Inventory(one_node(8 * GIB, 2, name="small").devices + one_node(16 * GIB, 2, name="x").devices + one_node(9 * GIB, 4).devices))
    with pytest.raises(PlacementError, match=r"'fat'.*20\.0 GiB.*16\.0 GiB"):
        check_fits([Request("fat", 1, 20 * GIB)], inv)
    with pytest.raises(PlacementError, match="'none'"):
        check_fits([Request("none", 0, GIB)], inv)
    with pytest.raises(PlacementError, match="'empty'"):
        pack([Request("empty", 1, 0)], inv)


def test_check_fits_allows_a_gang_across_nodes_only_when_asked():
    nodes = tuple(Device(f"n{n}/gpu{i}", f"n{n}", i, "gpu", "g", GIB)
                  for n in range(2) for i in range(2))
    inv, wide = Inventory(nodes), Request("wide", 3, GIB)
    with pytest.raises(PlacementError, match="'wide'"):
        check_fits([wide], inv)
    check_fits([wide], inv, multi_node=True)
    assert pack([wide], inv) == []
    spread = pack([wide], inv, multi_node=True)[0]
    assert len(spread.device_ids) == 3


def test_a_resize_grows_on_its_node_and_spreads_to_the_fullest_other_node_only_when_allowed():
    devices = [Device(f"{n}/gpu{i}", n, i, "gpu", "g", 8 * GIB) for n, count in (("a", 2), ("b", 1), ("c", 3)) for i in range(count)]
    inventory = Inventory(tuple(devices), {})
    used = {"a/gpu0": 8 * GIB, "c/gpu0": 8 * GIB}  # the trial's own device, and one another trial holds on c
    assert resize_devices(inventory, ["a/gpu0"], 2, 8 * GIB, used) == ("a/gpu0", "a/gpu1")
    assert resize_devices(inventory, ["a/gpu0"], 3, 8 * GIB, used) is None  # its node has only two
    # With spread: its node first, then c (two free) before b (one free); the fewest nodes.
    assert resize_devices(inventory, ["a/gpu0"], 4, 8 * GIB, used, spread=True) == ("a/gpu0", "a/gpu1", "c/gpu1", "c/gpu2")
    # A trial that spans b already grows there first, whatever is fuller.
    spanning = {**used, "b/gpu0": 8 * GIB}
    assert resize_devices(inventory, ["a/gpu0", "b/gpu0"], 3, 8 * GIB, spanning, spread=True) == ("a/gpu0", "b/gpu0", "a/gpu1")
    assert resize_devices(inventory, ["a/gpu0", "a/gpu1", "c/gpu1"], 2, 8 * GIB, used, spread=True) == ("a/gpu0", "a/gpu1")
    assert resize_devices(inventory, ["a/gpu0"], 7, 8 * GIB, used, spread=True) is None


def test_whole_devices_are_taken_on_nodes_whose_devices_differ_in_memory():
    """A lab of a 40 GiB box and an 80 GiB box: four one-device trials for whole devices run
    on all four devices, each alone; a shared request finds no room on them while they run,
    and an 80 GiB number (the old way to ask for a whole device) fits only the large box."""
    inv = Inventory(one_node(40 * GIB, 2, name="small").devices + one_node(80 * GIB, 2, name="large").devices)
    whole = [Request(f"w{i}", 1, WHOLE_DEVICE) for i in range(4)]
    check_fits(whole, inv)
    for policy in POLICIES:
        packer = Packer(inv, policy=policy)
        placed = [packer.place(r) for r in whole]
        assert all(placed) and sorted(d for p in placed for d in p.device_ids) == sorted(d.id for d in inv.devices), policy
        assert all(packer.free_bytes(d.id) == 0 for d in inv.devices)  # each device taken whole: nothing left to share
        assert packer.place(Request("shared", 1, GIB)) is None
        packer.release(placed[0])
        assert packer.free_bytes(placed[0].device_ids[0]) == inv.device(placed[0].device_ids[0]).memory_bytes
    by_number = pack([Request(f"n{i}", 1, 80 * GIB) for i in range(4)], inv)
    assert sorted(d for p in by_number for d in p.device_ids) == ["large/gpu0", "large/gpu1"]
    # A whole device is never one another trial shares, however little it holds.
    assert pack([Request("w", 1, WHOLE_DEVICE)], inv, {"small/gpu0": 1, "small/gpu1": 1, "large/gpu0": 1}) == [
        Placement("w", ("large/gpu1",), WHOLE_DEVICE)]
    assert Placement("w", ("small/gpu0",), WHOLE_DEVICE).claims({"small/gpu0": 40 * GIB}) == {"small/gpu0": 40 * GIB}


def test_a_whole_device_trial_grows_onto_a_device_of_another_size():
    devices = [Device("a/gpu0", "a", 0, "gpu", "g", 40 * GIB), Device("b/gpu0", "b", 0, "gpu", "g", 80 * GIB),
               Device("b/gpu1", "b", 1, "gpu", "g", 80 * GIB)]
    inventory = Inventory(tuple(devices), {})
    used = {"a/gpu0": 40 * GIB, "b/gpu1": GIB}  # its own device, and a little of another trial's on b/gpu1
    assert resize_devices(inventory, ["a/gpu0"], 2, WHOLE_DEVICE, used, spread=True) == ("a/gpu0", "b/gpu0")
    assert resize_devices(inventory, ["a/gpu0"], 3, WHOLE_DEVICE, used, spread=True) is None  # b/gpu1 is not whole
