"""Sizing: fixed, ranged and auto requests; measured memory; starting sizes that leave room."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cluster.inventory import DeclaredNode, declared_inventory
from cluster.packing import pack
from cluster.sizing import MemoryEstimate, SizingError, measure_memory, size_request, start_size
from training.spec import parse_spec
from tasks.grid import expand_grid
from tasks.sizing import size_trials

GIB = 2**30


def gpus(count: int, memory_gib: float = 16, nodes: int = 1):
    return declared_inventory([DeclaredNode(f"n{i}", count, int(memory_gib * GIB)) for i in range(nodes)])


def test_measured_memory_counts_weights_and_saved_activations():
    model = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 10))
    x, y = torch.randn(32, 100), torch.zeros(32, dtype=torch.long)
    est = measure_memory(model, x, y, F.cross_entropy, optimizer_state_per_param=1, on_gpu=False)
    params = (100 * 50 + 50 + 50 * 10 + 10) * 4
    assert est.params_bytes == est.grads_bytes == est.optimizer_bytes == params
    # Backward needs at least the input and the hidden activation; never more than a few copies.
    assert 32 * (100 + 50) * 4 <= est.activations_bytes <= 4 * 32 * (100 + 50 + 50 + 10) * 4
    bigger = measure_memory(model, torch.randn(64, 100), torch.zeros(64, dtype=torch.long), F.cross_entropy, 1, False)
    assert bigger.activations_bytes > 1.8 * est.activations_bytes  # activations scale with the batch
    assert all(p.grad is None for p in model.parameters())  # the dry run leaves the model clean


def test_a_gpu_estimate_holds_the_context_and_the_cublas_workspaces_once_per_process():
    """On an H200 (docs/gpu-proof/) a 2 MB model's peak allocated was 68 MB, the size of two
    32 MiB cuBLAS workspaces; the CUDA context lies outside the allocator, on top of it."""
    from cluster.sizing import GPU_CONTEXT_BYTES, GPU_WORKSPACE_BYTES

    model = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 10))
    x, y = torch.randn(32, 100), torch.zeros(32, dtype=torch.long)
    cpu = measure_memory(model, x, y, F.cross_entropy, 1, on_gpu=False)
    gpu = measure_memory(model, x, y, F.cross_entropy, 1, on_gpu=True)
    assert GPU_WORKSPACE_BYTES >= 64 * 2**20
    assert gpu.per_device(1) - cpu.per_device(1) == GPU_CONTEXT_BYTES + GPU_WORKSPACE_BYTES
    assert gpu.per_device(2) - cpu.per_device(2) == GPU_CONTEXT_BYTES + GPU_WORKSPACE_BYTES  # per process, not split


def test_per_device_memory_shrinks_only_with_activations():
    est = MemoryEstimate(params_bytes=100, grads_bytes=100, optimizer_bytes=100, activations_bytes=800, margin=1.0)
    assert est.per_device(1) == 1100 and est.per_device(2) == 700 and est.per_device(4) == 500


def test_fixed_range_and_memory_forms():
    inv = gpus(8)
    assert size_request("t", 2, None, inv).at(2).whole  # a whole GPU
    shared = size_request("t", 1, 3.5, inv)
    assert shared.at(1).memory_bytes == int(3.5 * GIB)
    ranged = size_request("t", (2, 4), None, inv)
    assert list(ranged.sizes) == [2, 3, 4]


def test_cpu_slots_are_never_shared():
    from cluster.inventory import discover

    inv = discover(nvml=None, cpu_slots=2)
    assert inv.kind == "cpu"
    request = size_request("t", 1, 0.001, inv)
    assert request.at(1).whole


def test_auto_picks_fewest_devices_that_fit():
    est = MemoryEstimate(params_bytes=GIB, grads_bytes=GIB, optimizer_bytes=GIB, activations_bytes=30 * GIB, margin=1.0)
    # 1 device: 33 GiB, 2: 18, 3: 13 GiB <= 16.
    request = size_request("big", "auto", "auto", gpus(8), est)
    assert (request.min_devices, request.max_devices) == (3, 3)
    assert request.at(3).memory_bytes == est.per_device(3)


def test_auto_that_cannot_fit_names_the_trial():
    est = MemoryEstimate(params_bytes=20 * GIB, grads_bytes=0, optimizer_bytes=0, activations_bytes=0, margin=1.0)
    with pytest.raises(SizingError, match="trial 'huge'.*smaller batch or model"):
        size_request("huge", "auto", "auto", gpus(8), est)
    with pytest.raises(SizingError, match="trial 'x'.*no.*estimate|trial 'x'.*estimate"):
        size_request("x", "auto", None, gpus(8), None)


def small_trials(digits_npz, steps: int):
    return parse_spec({
        "campaign": {"name": "share"}, "model": {"name": "small_cnn", "width": 8}, "data": {"path": str(digits_npz)},
        "training": {"steps": steps, "batch_size": 64, "lr": 0.1}, "grid": {"training.lr": [0.1, 0.2, 0.3, 0.4]},
        "resources": {"devices": 1, "memory_gb": "auto"},
    })


def test_small_trials_share_one_gpu_by_memory(digits_npz):
    spec = small_trials(digits_npz, steps=5000)
    inv = gpus(1, memory_gib=16)
    requests = size_trials(spec, expand_grid(spec), inv)
    placed = pack([r.at(1) for r in requests.values()], inv)
    assert len(placed) == 4 and {p.device_ids for p in placed} == {(inv.devices[0].id,)}
    # The estimate is measured, not a constant: a wider model needs more.
    wide = parse_spec({**spec.model_dump(mode="json"), "model": {"name": "small_cnn", "width": 256}})
    wide_request = next(iter(size_trials(wide, expand_grid(wide), inv).values()))
    assert wide_request.at(1).memory_bytes > next(iter(requests.values())).at(1).memory_bytes


def test_trials_too_short_to_pay_for_a_process_each_get_a_whole_gpu(digits_npz):
    """On an H200 the default campaign's four 300-step trials ran 0.88x as fast packed as one
    at a time on a warm worker: each packed trial paid a process's start for 0.5 s of work."""
    inv = gpus(2, memory_gib=16)
    short = size_trials(small_trials(digits_npz, steps=10), expand_grid(small_trials(digits_npz, steps=10)), inv)
    assert all(r.at(1).whole for r in short.values())
    placed = pack([r.at(1) for r in short.values()], inv)
    assert len({p.device_ids for p in placed}) == len(placed) == 2  # one trial per GPU, the rest wait
    # The same trials with enough steps share; and on CPU slots nothing changes.
    long = small_trials(digits_npz, steps=5000)
    assert all(r.at(1).memory_bytes < GIB for r in size_trials(long, expand_grid(long), inv).values())


def test_packing_pays_when_the_work_in_all_outweighs_a_process_start():
    from cluster.sizing import GPU_PROCESS_START_S, device_seconds, packing_pays

    assert not packing_pays([0.5] * 4, expected_trials=4)
    assert packing_pays([0.5] * 4, expected_trials=int(GPU_PROCESS_START_S / 0.5))  # a search's budget counts
    assert packing_pays([4.0] * 2, expected_trials=2) and not packing_pays([], 0)
    est = MemoryEstimate(params_bytes=0, grads_bytes=0, optimizer_bytes=0, activations_bytes=0, ops_per_step=100)
    assert device_seconds(est, steps=1000, passes_per_step=2) == pytest.approx(2 * device_seconds(est, steps=1000))


def test_the_estimate_counts_the_evaluation_peak_the_data_on_the_device_and_the_ops():
    model = nn.Sequential(nn.Linear(100, 400), nn.ReLU(), nn.Linear(400, 10))
    x, y = torch.randn(8, 100), torch.zeros(8, dtype=torch.long)
    plain = measure_memory(model, x, y, F.cross_entropy, 1, on_gpu=True)
    evaluated = measure_memory(model, x, y, F.cross_entropy, 1, on_gpu=True, eval_input=torch.randn(256, 100), resident_bytes=10**6)
    # No grad, 256 samples: the 400-wide hidden layer (in place ReLU or not) is live at the peak.
    assert 256 * 400 * 4 <= evaluated.eval_bytes <= 3 * 256 * (400 + 10) * 4
    assert evaluated.per_device(1) - plain.per_device(1) >= 10**6 + (evaluated.eval_bytes - plain.activations_bytes) * 1.25 - 1
    assert evaluated.per_device(2) - evaluated.per_device(1) == 0  # evaluation's peak dominates; it is not split
    assert plain.ops_per_step >= 6  # two matmuls, an activation, the loss, and their backward
    bf16 = measure_memory(model, x, y, F.cross_entropy, 1, on_gpu=False, autocast_dtype=torch.bfloat16)
    assert bf16.activations_bytes < plain.activations_bytes  # saved under autocast: half the bytes


def test_a_whole_device_is_any_device_unless_the_trial_needs_more_than_the_smallest():
    """On a 16 GiB and a 40 GiB node, a whole-device trial takes any device; one whose
    estimate needs more than 16 GiB asks for 40 GiB, which only the large node has."""
    from cluster.sizing import whole_devices
    from cluster.types import WHOLE_DEVICE

    inv = declared_inventory([DeclaredNode("small", 2, 16 * GIB), DeclaredNode("large", 2, 40 * GIB)])
    assert whole_devices(inv, None) == whole_devices(inv, 16 * GIB) == WHOLE_DEVICE
    assert whole_devices(inv, 16 * GIB + 1) == 40 * GIB
    assert size_request("t", (1, 4), None, inv).at(3).whole
    est = MemoryEstimate(params_bytes=GIB, grads_bytes=GIB, optimizer_bytes=GIB, activations_bytes=30 * GIB, margin=1.0)
    auto = size_request("t", "auto", None, inv, est)  # 3 + 30/n GiB: one device of the large node holds 33
    assert (auto.min_devices, auto.at(1).memory_bytes) == (1, 40 * GIB)
    small = MemoryEstimate(params_bytes=GIB, grads_bytes=GIB, optimizer_bytes=GIB, activations_bytes=10 * GIB, margin=1.0)
    assert size_request("t", "auto", None, inv, small).at(1).whole  # 13 GiB: any device holds it


def test_start_size_leaves_room_for_the_queue():
    inv = gpus(4)
    elastic = size_request("e", (1, 4), None, inv)
    place = lambda n: n  # everything fits: only the budget decides
    assert start_size(elastic, place, others_waiting_min=0, free_devices=4) == 4
    assert start_size(elastic, place, others_waiting_min=2, free_devices=4) == 2
    assert start_size(elastic, place, others_waiting_min=9, free_devices=4) == 1  # its minimum at least
    assert start_size(elastic, lambda n: None, 0, 4) is None


def test_campaign_plan_places_on_the_declared_cluster(tmp_path, digits_npz):
    import yaml

    from conftest import campaign_cli

    spec = {
        "campaign": {"name": "plan"}, "model": {"name": "small_cnn", "width": 8}, "data": {"path": str(digits_npz)},
        "training": {"steps": 10, "batch_size": 64, "lr": 0.1}, "grid": {"training.lr": [0.1, 0.2, 0.3]},
        "resources": {"devices": 2},
        "cluster": {"nodes": [{"name": "a", "devices": 2, "memory_gb": 16, "nvlink_pairs": [[0, 1]]},
                              {"name": "b", "devices": 2, "memory_gb": 16}]},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = campaign_cli("plan", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("waits for devices") == 1  # two 2-device gangs fit, the third waits
    assert "a/gpu0, a/gpu1" in result.stdout and "b/gpu0, b/gpu1" in result.stdout  # gangs kept on one node

    spec["cluster"]["nodes"][1]["nvlink_pairs"] = [[0, 5]]
    path.write_text(yaml.safe_dump(spec))
    result = campaign_cli("plan", str(path))
    assert result.returncode == 2 and "'b'" in result.stderr  # the inconsistent node is named


def test_campaign_plan_gives_whole_devices_of_every_size(tmp_path, digits_npz):
    """A lab of a 40 GiB box and an 80 GiB box: four trials for a whole device each start on
    all four devices, not only on the 80 GiB ones."""
    import yaml

    from conftest import campaign_cli

    spec = {
        "campaign": {"name": "lab"}, "model": {"name": "small_cnn", "width": 8}, "data": {"path": str(digits_npz)},
        "training": {"steps": 10, "batch_size": 64, "lr": 0.1}, "grid": {"training.lr": [0.1, 0.2, 0.3, 0.4]},
        "cluster": {"nodes": [{"name": "small", "devices": 2, "memory_gb": 40}, {"name": "large", "devices": 2, "memory_gb": 80}]},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(spec))
    result = campaign_cli("plan", str(path))
    assert result.returncode == 0, result.stderr
    assert "waits for devices" not in result.stdout and result.stdout.count("whole device") == 4, result.stdout
    for device in ("small/gpu0", "small/gpu1", "large/gpu0", "large/gpu1"):
        assert device in result.stdout, result.stdout


def test_the_default_campaign_fits_a_one_gpu_machine(digits_npz):
    """`make campaign` on one GPU: its four trials are ~0.6 s of work each, too little to pay
    for a process each (0.88x packed on an H200), so they take the GPU one after another."""
    import yaml

    from cluster.inventory import discover
    from cluster.packing import Packer, PlacementError
    from conftest import REPO
    from flows.run.campaign import checked_requests
    from tests.fakes.fake_nvml import FakeGpu, FakeNvml, gpu_uuid

    one_gpu = discover(FakeNvml([FakeGpu(gpu_uuid(0, 0))]), node="box")
    assert len(one_gpu.devices) == 1 and one_gpu.kind == "gpu"
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["data"]["path"] = str(digits_npz)
    spec = parse_spec(raw)
    trials = expand_grid(spec)
    requests = checked_requests(spec, trials, one_gpu)
    packer = Packer(one_gpu)
    placed = [packer.place(requests[t.id].at(requests[t.id].min_devices)) for t in trials]
    assert placed[0] is not None and placed[0].device_ids == (one_gpu.devices[0].id,), placed
    assert placed[1:] == [None] * (len(trials) - 1)  # the others wait for it, whole-device trials
    packer.release(placed[0])
    assert packer.place(requests[trials[1].id].at(1)) is not None
    assert all(t.spec.training.logical_ranks == 2 for t in trials)  # a 2-rank DDP result, on one device

    # Asking more devices than there are is refused, saying how many there are.
    raw["resources"] = {"devices": 2}
    wide = parse_spec(raw)
    with pytest.raises(PlacementError, match=r"needs 2 devices; the largest node, 'box', has 1 \(gpu device\)"):
        checked_requests(wide, expand_grid(wide), one_gpu)


def test_the_data_a_gpu_feed_keeps_is_what_the_estimate_counts():
    """The feed keeps a tensor data set on the GPU when asked or when it is small enough; the
    packer's estimate counts exactly those bytes (pure: no GPU needed)."""
    from torch.utils.data import TensorDataset

    from training.batches import DEVICE_BYTES_AUTO, keeps_on_device, kept_on_device

    small = TensorDataset(torch.zeros(10, 4), torch.zeros(10))
    assert kept_on_device(small, "auto", 16 * GIB) == 10 * 4 * 4 + 10 * 4
    assert kept_on_device(small, "auto", 0) is None and kept_on_device(small, False, 16 * GIB) is None
    big = TensorDataset(torch.zeros(1, 1).expand(DEVICE_BYTES_AUTO // 4 + 1, 1), torch.zeros(1).expand(DEVICE_BYTES_AUTO // 4 + 1))
    assert kept_on_device(big, "auto", 1024 * GIB) is None and kept_on_device(big, True, 0) is not None
    pairs = [(torch.zeros(3), torch.tensor(1)) for _ in range(4)]  # not a TensorDataset: only when asked
    assert kept_on_device(pairs, "auto", 16 * GIB) is None and kept_on_device(pairs, True, 0) == 4 * 3 * 4 + 4 * 8
    cpu = torch.device("cpu")  # on the CPU the data is where the model is: kept unless refused
    assert keeps_on_device(small, "auto", cpu) and keeps_on_device(pairs, True, cpu)
    assert not keeps_on_device(small, False, cpu) and not keeps_on_device(pairs, "auto", cpu)
