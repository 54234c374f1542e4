"""Device inventory: GPUs through a fake NVML, CPU slots, declared clusters, the report."""

from __future__ import annotations

import json
import os
from itertools import combinations

import pynvml
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from cluster.inventory import (
    DeclaredNode,
    InventoryError,
    declared_inventory,
    device_usage,
    discover,
    visible_devices_env,
)
from cluster.leases import Lease
from cluster.report import render_cluster
from cluster.types import Inventory, Link
from tests.fakes.fake_nvml import FakeNvml, GiB, eight_gpu_node, gpu_uuid, no_nvml

NVLINK_PAIRS = {frozenset(p) for p in ((0, 1), (2, 3), (4, 5), (6, 7))}


def _expected_link(i: int, j: int) -> Link:
    """The fake node's wiring, in words: bridges in pairs, GPUs 0-3 on socket 0, 4-7 on 1."""
    if frozenset((i, j)) in NVLINK_PAIRS:
        return Link.NVLINK
    return Link.PCIE_HOST if i // 4 == j // 4 else Link.CROSS_SOCKET


def test_two_eight_gpu_nodes_discovered_separately():
    nvmls = {"a": eight_gpu_node(0), "b": eight_gpu_node(1)}
    parts = [discover(nvml, node=name) for name, nvml in nvmls.items()]
    cluster = Inventory(parts[0].devices + parts[1].devices, {**parts[0].links, **parts[1].links})

    assert [(d.node, d.index) for d in cluster.devices] == [(n, i) for n in "ab" for i in range(8)]
    assert [d.id for d in cluster.devices] == [gpu_uuid(n, i) for n in (0, 1) for i in range(8)]
    assert all(d.kind == "gpu" and d.memory_bytes == 80 * GiB and "H100" in d.name for d in cluster.devices)
    for a, b in combinations(cluster.devices, 2):
        want = _expected_link(a.index, b.index) if a.node == b.node else Link.NETWORK
        assert cluster.link(a.id, b.id) == want, (a.node, a.index, b.node, b.index)
    # Every NVML session that was opened was shut down.
    assert all(n.sessions_opened == 1 and n.active_sessions == 0 for n in nvmls.values())


def test_a_shared_pcie_switch_is_seen():
    inventory = discover(eight_gpu_node(0, pcie_switches=((0, 2), (5, 7))), node="n")
    ids = [d.id for d in inventory.devices]
    assert inventory.link(ids[0], ids[2]) == inventory.link(ids[5], ids[7]) == Link.PCIE_SWITCH
    assert inventory.link(ids[1], ids[3]) == Link.PCIE_HOST
    assert inventory.link(ids[0], ids[1]) == Link.NVLINK  # NVLink beats the switch


def test_behind_an_nvswitch_every_pair_is_nvlink():
    inventory = discover(eight_gpu_node(0, nvswitch=True), node="n")
    assert {inventory.link(a.id, b.id) for a, b in combinations(inventory.devices, 2)} == {Link.NVLINK}


def test_a_lost_gpu_is_left_out_with_a_warning():
    nvml = eight_gpu_node(0)
    nvml.gpus[3].lost = True
    with pytest.warns(UserWarning, match="GPU 3"):
        inventory = discover(nvml, node="n")
    assert [d.index for d in inventory.devices] == [0, 1, 2, 4, 5, 6, 7]
    assert inventory.link(gpu_uuid(0, 6), gpu_uuid(0, 7)) == Link.NVLINK
    assert nvml.active_sessions == 0


@pytest.mark.parametrize("nvml", [no_nvml(), FakeNvml([])], ids=["no-driver", "no-gpu"])
def test_without_gpus_cpu_slots_share_the_host(nvml):
    inventory = discover(nvml, cpu_slots=3, node="box")
    cores = sorted(os.sched_getaffinity(0))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert [d.id for d in inventory.devices] == ["box/cpu0", "box/cpu1", "box/cpu2"]
    assert [d.index for d in inventory.devices] == [cores[i % len(cores)] for i in range(3)]
    assert {d.kind for d in inventory.devices} == {"cpu"} and inventory.kind == "cpu"
    # A slot is a core with its share of the host's memory, however many slots are declared:
    # nodes of one pool on one host (tests/test_pool.py) have alike slots.
    assert {d.memory_bytes for d in inventory.devices} == {ram // len(cores)}
    assert {d.memory_bytes for d in discover(nvml, cpu_slots=1, node="box").devices} == {ram // len(cores)}


def test_cpu_slots_default_to_the_usable_cores_and_must_be_positive():
    assert len(discover(no_nvml(), node="box").devices) == len(os.sched_getaffinity(0))
    with pytest.raises(InventoryError, match="box"):
        discover(no_nvml(), cpu_slots=0, node="box")


def test_real_pynvml_on_this_machine():
    """No fake: whatever this machine has, discover() agrees with NVML itself."""
    try:
        pynvml.nvmlInit()
        gpus = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        gpus = 0
    inventory = discover(cpu_slots=2)
    if gpus:
        assert inventory.kind == "gpu" and len(inventory.devices) == gpus
    else:
        assert inventory.kind == "cpu" and len(inventory.devices) == 2


def test_device_usage_reports_live_memory_and_load():
    nvml = eight_gpu_node(0)
    nvml.gpus[0].used_bytes, nvml.gpus[0].utilization_pct = 30 * GiB, 87
    nvml.gpus[1].utilization_pct = None  # as on a MIG instance
    usage = device_usage(nvml)
    assert set(usage) == {gpu_uuid(0, i) for i in range(8)}
    first, second = usage[gpu_uuid(0, 0)], usage[gpu_uuid(0, 1)]
    assert (first.free_bytes, first.used_bytes, first.utilization_pct) == (50 * GiB, 30 * GiB, 87)
    assert second.utilization_pct is None and second.free_bytes == 80 * GiB
    assert device_usage(no_nvml()) == {}


def test_visible_devices_env():
    gpus = discover(eight_gpu_node(0), node="n").devices
    assert visible_devices_env([gpus[5], gpus[2]]) == {
        "CUDA_VISIBLE_DEVICES": f"{gpu_uuid(0, 5)},{gpu_uuid(0, 2)}"
    }
    slots = discover(no_nvml(), cpu_slots=2, node="box").devices
    cores = ",".join(str(d.index) for d in slots)
    assert visible_devices_env(slots) == {"CUDA_VISIBLE_DEVICES": "", "CAMPAIGN_CPU_CORES": cores}
    declared = declared_inventory([DeclaredNode("d", 4, GiB)]).devices
    assert visible_devices_env(declared[2:]) == {"CUDA_VISIBLE_DEVICES": "2,3"}  # no UUID: ordinals
    with pytest.raises(ValueError):
        visible_devices_env([])
    with pytest.raises(ValueError, match="one env per node"):
        visible_devices_env([gpus[0], declared[0]])


def test_declared_cluster():
    inventory = declared_inventory(
        [
            DeclaredNode("a", 4, 40 * GiB, model="A100", nvlink_pairs=((0, 1),)),
            DeclaredNode("b", 2, 8 * GiB, kind="cpu"),
        ]
    )
    assert [d.id for d in inventory.devices] == ["a/gpu0", "a/gpu1", "a/gpu2", "a/gpu3", "b/cpu0", "b/cpu1"]
    assert inventory.device("a/gpu3").name == "A100" and inventory.device("b/cpu0").memory_bytes == 8 * GiB
    assert inventory.link("a/gpu0", "a/gpu1") == Link.NVLINK
    assert inventory.link("a/gpu0", "a/gpu2") == Link.PCIE_HOST
    assert inventory.link("a/gpu0", "b/cpu0") == Link.NETWORK


@pytest.mark.parametrize(
    "nodes, culprit",
    [
        ([DeclaredNode("a", 2, GiB), DeclaredNode("a", 2, GiB)], "'a' is declared twice"),
        ([DeclaredNode("a", 0, GiB)], "devices=0"),
        ([DeclaredNode("a", 2, 0)], "memory_bytes=0"),
        ([DeclaredNode("a", 2, GiB, nvlink_pairs=((1, 2),))], "nvlink pair (1, 2)"),
        ([DeclaredNode("a", 2, GiB, nvlink_pairs=((1, 1),))], "nvlink pair (1, 1)"),
        ([DeclaredNode("a", 2, GiB, kind="cpu", nvlink_pairs=((0, 1),))], "only apply to GPUs"),
        ([DeclaredNode("a", 2, GiB, kind="tpu")], "'tpu'"),
        ([DeclaredNode("a/b", 2, GiB)], "'a/b'"),
        ([], "no node"),
    ],
)
def test_declared_cluster_mistakes_name_the_node(nodes, culprit):
    with pytest.raises(InventoryError) as error:
        declared_inventory(nodes)
    assert culprit in str(error.value)


@st.composite
def declared_clusters(draw):
    nodes = []
    for n in range(draw(st.integers(1, 4))):
        count = draw(st.integers(1, 8))
        pairs = draw(
            st.lists(
                st.tuples(st.integers(0, count - 1), st.integers(0, count - 1)).filter(
                    lambda p: p[0] != p[1]
                ),
                max_size=6,
            )
        )
        nodes.append(
            DeclaredNode(f"node{n}", count, draw(st.integers(1, 1 << 40)), nvlink_pairs=tuple(pairs))
        )
    return nodes


@given(declared_clusters())
def test_declared_links_are_exactly_what_was_declared(nodes):
    inventory = declared_inventory(nodes)
    assert len(inventory.devices) == len({d.id for d in inventory.devices}) == sum(n.devices for n in nodes)
    specs = {n.name: n for n in nodes}
    for a, b in combinations(inventory.devices, 2):
        pairs = {frozenset(p) for p in specs[a.node].nvlink_pairs}
        if a.node != b.node:
            want = Link.NETWORK
        else:
            want = Link.NVLINK if frozenset((a.index, b.index)) in pairs else Link.PCIE_HOST
        assert inventory.link(a.id, b.id) == want
        assert a.memory_bytes == specs[a.node].memory_bytes


def test_cluster_report_shows_holders_and_what_is_left():
    nvml = eight_gpu_node(0)
    nvml.gpus[0].used_bytes, nvml.gpus[0].utilization_pct = 30 * GiB, 87
    inventory = discover(nvml, node="n")
    gpu0 = inventory.devices[0].id
    leases = [
        Lease("sweep/lr=0.1", gpu0, 20 * GiB, 1, None, 0.0, 0.0),
        Lease("sweep/lr=0.2", gpu0, 4 * GiB, 1, None, 0.0, 0.0),
        Lease("other/t", "far/gpu0", GiB, 1, None, 0.0, 0.0),
    ]
    console = Console(record=True, width=250)
    console.print(render_cluster(inventory, leases, device_usage(nvml)))
    lines = console.export_text().splitlines()
    row = next(line for line in lines if gpu0 in line)
    assert "sweep/lr=0.1 (20.0 GiB)" in row and "56.0 GiB" in row and "50.0 GiB" in row and "87%" in row
    assert any("sweep/lr=0.2 (4.0 GiB)" in line for line in lines)
    assert any("far/gpu0" in line and "other/t (1.0 GiB)" in line for line in lines)
    idle = [line for line in lines if any(d.id in line for d in inventory.devices[1:])]
    assert len(idle) == 7 and all(line.count("80.0 GiB") == 3 for line in idle)  # memory, unleased, live


def test_the_orchestrator_moves_off_the_slots_cores_and_the_slots_stay_where_they_were():
    """`campaign launch` pins itself to the cores no slot trains on; the inventory it (and
    every child) discovers afterwards still draws its slots from all the host's cores. Run in
    a process of its own: it changes that process's affinity."""
    import os
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    code = (
        "import os, json\n"
        "from cluster.inventory import discover, keep_off_cores, spare_cores\n"
        "before = [d.index for d in discover(cpu_slots=1).devices]\n"
        "spare = spare_cores(discover(cpu_slots=1))\n"
        "keep_off_cores(spare)\n"
        "print(json.dumps({'before': before, 'after': [d.index for d in discover(cpu_slots=1).devices],\n"
        "                  'spare': sorted(spare), 'mine': sorted(os.sched_getaffinity(0))}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CAMPAIGN_HOST_CORES"}
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout)
    assert out["after"] == out["before"]  # the slot is the same core
    assert out["mine"] == out["spare"] and out["before"][0] not in out["mine"]
