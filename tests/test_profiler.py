"""The per-layer profiler, the roofline, the DDP measurement and the step-time prior."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cluster.step_time_prior import BatchCurve, Bucket, LinkParams, ProfileStepTimeModel, emulate_buckets, measured_buckets
from training.errors import CampaignError
from training.models import MLP, SmallCNN
from training.profiler import (
    BatchTooLargeError, BucketProfile, DdpProfile, LayerProfile, LayerTraceError, LinkEstimate, ModelProfile, StepTiming,
    COLUMNS, profile_model, table_rows, to_markdown, to_rich_table,
)
from training.roofline import DevicePeaks, DeviceUnavailableError, plot_roofline, probe_device, read_nvml

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
PEAKS = DevicePeaks("cpu", "test cpu", peak_flops=50e9, peak_bytes_per_s=10e9, threads=1)  # ridge 5 FLOP/B


def digits(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch, 1, 8, 8), torch.randint(0, 10, (batch,))


def layer(profile: ModelProfile, name: str) -> LayerProfile:
    return next(l for l in profile.layers if l.name == name)


def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --- FLOPs, bytes, times -----------------------------------------------------------------------

@settings(max_examples=8, deadline=None)
@given(batch=st.integers(1, 32), hidden=st.integers(1, 48), out=st.integers(1, 12))
def test_linear_flops_are_exact_and_backward_skips_the_input_gradient_of_the_first_layer(batch, hidden, out):
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, out))
    profile = profile_model(model, (torch.rand(batch, 1, 8, 8), torch.randint(0, out, (batch,))), F.cross_entropy, CPU, repeats=1)
    first, last = layer(profile, "1"), layer(profile, "3")
    assert first.forward_flops == 2 * batch * 64 * hidden
    assert last.forward_flops == 2 * batch * hidden * out
    # flop_counter counts one matmul per gradient: weight always, input only where it needs one.
    assert first.backward_flops == first.forward_flops
    assert last.backward_flops == 2 * last.forward_flops
    assert layer(profile, "2").flops == 0  # elementwise ops are not counted by flop_counter


@pytest.mark.parametrize("width", [4, 16])
def test_conv_flops_are_exact(width):
    batch = 8
    profile = profile_model(SmallCNN(width=width), digits(batch), F.cross_entropy, CPU, repeats=2)
    conv1, conv2, head = layer(profile, "features.0"), layer(profile, "features.2"), layer(profile, "head.2")
    assert conv1.forward_flops == 2 * batch * width * 8 * 8 * 1 * 3 * 3
    assert conv2.forward_flops == 2 * batch * (2 * width) * 8 * 8 * width * 3 * 3
    assert head.forward_flops == 2 * batch * (2 * width * 4 * 4) * 10
    assert conv1.backward_flops == conv1.forward_flops  # the image needs no gradient
    assert conv2.backward_flops == 2 * conv2.forward_flops


def test_profile_accounts_for_every_parameter_and_measures_every_layer():
    model = SmallCNN(width=8)
    before = [p.detach().clone() for p in model.parameters()]
    profile = profile_model(model, digits(32), F.cross_entropy, CPU, repeats=3)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the caller's model is untouched
    assert [l.name for l in profile.layers] == ["features.0", "features.1", "features.2", "features.3", "features.4", "head.0", "head.1", "head.2"]
    assert sum(l.params for l in profile.layers) == profile.parameter_count == sum(p.numel() for p in model.parameters())
    assert sum(l.gradient_bytes for l in profile.layers) == profile.gradient_bytes == grad_bytes(model)
    conv2 = layer(profile, "features.2")
    assert conv2.activation_in_bytes == 32 * 8 * 8 * 8 * 4 and conv2.activation_out_bytes == 32 * 16 * 8 * 8 * 4
    assert layer(profile, "head.0").bytes_moved == 0  # Flatten is a view
    # A layer's time and the whole step's come from separate timed runs: on a loaded host one
    # layer's median once exceeded the step's (share 1.6), so only that each is measured is asserted.
    for l in profile.layers:
        assert l.forward_s > 0 and l.share(profile.step.step_s) > 0
    assert layer(profile, "features.0").backward_s > 0  # the first layer's backward is timed too
    assert [s.batch_size for s in profile.scaling] == [32, 16, 8, 4]
    assert profile.step.step_s > 0 and profile.threads == 1
    assert ModelProfile.from_json(profile.to_json()) == profile


def test_in_place_layers_are_profiled_on_their_own_inputs():
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(inplace=True), nn.Linear(16, 10))
    relu = layer(profile_model(model, digits(8), F.cross_entropy, CPU, repeats=2), "2")
    assert relu.kind == "ReLU" and relu.bytes_moved > 0 and relu.backward_s > 0


def test_markdown_and_rich_tables_have_a_row_per_layer_and_name_the_bound():
    profile = profile_model(MLP(width=32, depth=1), digits(16), F.cross_entropy, CPU, repeats=2)
    md = to_markdown(profile, PEAKS)
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    assert len(rows) == len(profile.layers) + 2  # layers, the rest of the step, the total
    for l, row in zip(profile.layers, rows):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == l.name and cells[1] == l.kind
        assert cells[-1] == ("compute" if l.arithmetic_intensity >= 5 else "memory" if l.bytes_moved else "none")
    assert to_rich_table(profile, PEAKS).row_count == len(profile.layers) + 2


def test_the_profile_and_prediction_tables_fit_80_columns_with_every_figure_whole():
    """At 80 columns every column of the profile would be cut to 'f…': the narrow table keeps the
    layer names, arithmetic intensity, times and bound whole; the predictions' headers wrap."""
    from rich.console import Console

    from tasks.profile import PREDICTION_COLUMNS, prediction_table

    profile = profile_model(SmallCNN(width=16), digits(32), F.cross_entropy, CPU, repeats=1)
    rows = table_rows(profile, PEAKS)
    narrow, wide = Console(width=80, record=True), Console(width=400, record=True)
    narrow.print(to_rich_table(profile, PEAKS, 80))
    wide.print(to_rich_table(profile, PEAKS, 400))
    text = narrow.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    for row in rows[:-2]:
        line = next(line for line in text.splitlines() if line.split() and line.split()[0] == row[0])
        assert [row[COLUMNS.index(c)] for c in ("FLOP/B", "fwd ms", "bwd ms", "share", "bound")] == line.split()[-5:]
    every = wide.export_text()
    assert all(column in every for column in ("act out", "bytes moved"))  # every column when it fits
    figures = [["4", "16", "12.345", "13.001", "11.000", "1.234", "0.100", "0.010", "123,456", "1.85x"]]
    narrow.print(prediction_table("predicted step time", figures, 80))
    text = narrow.export_text().split("predicted step time")[1]
    assert "…" not in text and all(figure in text.split() for figure in figures[0]), text
    assert len(PREDICTION_COLUMNS) == len(figures[0])


# --- roofline ----------------------------------------------------------------------------------

def test_probe_measures_positive_peaks_and_the_plot_is_a_png(tmp_path):
    peaks = probe_device(CPU, repeats=2)
    assert peaks.peak_flops > 1e8 and peaks.peak_bytes_per_s > 1e8 and peaks.threads == 1
    profile = profile_model(SmallCNN(width=8), digits(16), F.cross_entropy, CPU, repeats=2)
    path = plot_roofline(profile, peaks, tmp_path / "sub" / "roofline.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def fake_pynvml(fail: bool = False) -> types.ModuleType:
    """NVML for an H100 SXM as the driver reports it (no GPU here: fake at the pynvml boundary)."""
    m = types.ModuleType("pynvml")
    m.NVMLError = type("NVMLError", (Exception,), {})
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM = 1, 2

    def init():
        if fail:
            raise m.NVMLError("driver not loaded")

    m.nvmlInit, m.nvmlShutdown = init, lambda: None
    m.nvmlDeviceGetHandleByIndex = lambda i: ("index", i)
    m.nvmlDeviceGetHandleByUUID = lambda u: ("uuid", u)
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=80 * 2**30)
    m.nvmlDeviceGetMaxClockInfo = lambda h, clock: {1: 1980, 2: 2619}[clock]
    m.nvmlDeviceGetMemoryBusWidth = lambda h: 5120
    return m


def test_nvml_gives_the_theoretical_bandwidth_and_its_absence_is_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    info = read_nvml(0, "GPU-1234")
    assert info.name == "NVIDIA H100 80GB HBM3" and info.max_sm_clock_mhz == 1980
    assert info.theoretical_bytes_per_s == pytest.approx(3.35e12, rel=0.01)  # the H100 SXM data sheet
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail=True))
    assert read_nvml(0) is None


# --- bad input ---------------------------------------------------------------------------------

class Explodes(nn.Module):
    def forward(self, x):
        raise ValueError("unsupported input")


class HugeBuffer(nn.Module):
    def forward(self, x):
        return x.new_empty(2**50)  # 4 PiB: no host can hold it


@pytest.mark.parametrize(
    "model, culprit",
    [
        (nn.Sequential(nn.Flatten(), nn.Linear(65, 10)), "layer 1 (Linear)"),  # 64 features arrive, 65 expected
        (nn.Sequential(nn.Flatten(), nn.Sequential(nn.ReLU(), Explodes())), "layer 1.1 (Explodes)"),
    ],
)
def test_a_layer_that_fails_is_named(model, culprit):
    with pytest.raises(LayerTraceError, match=culprit.replace("(", r"\(").replace(")", r"\)")) as err:
        profile_model(model, digits(4), F.cross_entropy, CPU, repeats=1)
    assert isinstance(err.value, CampaignError)


def test_a_loss_that_is_not_a_scalar_is_refused():
    with pytest.raises(LayerTraceError, match="scalar"):
        profile_model(MLP(width=8, depth=1), digits(4), lambda out, y: out, CPU, repeats=1)


def test_a_batch_that_does_not_fit_names_device_and_layer():
    with pytest.raises(BatchTooLargeError, match=r"batch of 4 .* cpu \(layer 1 \(HugeBuffer\)\)"):
        profile_model(nn.Sequential(nn.Flatten(), HugeBuffer()), digits(4), F.cross_entropy, CPU, repeats=1)


class LosesDevice(nn.Module):
    """What a layer sees when its GPU falls off the bus (no GPU here to unplug)."""

    def forward(self, x):
        raise RuntimeError("CUDA error: unspecified launch failure")


def test_a_missing_or_lost_device_is_named():
    with pytest.raises(DeviceUnavailableError, match="cuda:7"):
        profile_model(SmallCNN(), digits(4), F.cross_entropy, torch.device("cuda:7"))
    with pytest.raises(DeviceUnavailableError, match="cuda:7"):
        probe_device(torch.device("cuda:7"))
    with pytest.raises(DeviceUnavailableError, match=r"device cpu failed while profiling layer 1 \(LosesDevice\)"):
        profile_model(nn.Sequential(nn.Flatten(), LosesDevice()), digits(4), F.cross_entropy, CPU, repeats=1)


# --- DDP under real torchrun -------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_ddp_all_reduces_exactly_the_gradients(tmp_path, digits_npz):
    kwargs = {"width": 512, "depth": 2}  # 1.2 MB of gradients: more than DDP's 1 MiB first bucket
    out = tmp_path / "ddp.json"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "training.profile_ddp",
         "--workload", json.dumps({"model": {"name": "mlp", **kwargs}, "data": {"path": str(digits_npz)}}),
         "--batch-size", "32", "--steps", "5", "--warmup", "2", "--probe-bytes", "4096,262144", "--out", str(out)],
        env=env, cwd=REPO, check=True, capture_output=True, timeout=120,
    )
    ddp = DdpProfile.from_json(out.read_text())
    model = MLP(**kwargs)
    assert ddp.world_size == 2 and ddp.backend == "gloo" and ddp.global_batch == 32
    assert ddp.allreduce_bytes == sum(b.bytes for b in ddp.buckets) == grad_bytes(model)
    assert len(ddp.buckets) >= 2
    assert sorted(p for b in ddp.buckets for p in b.params) == sorted(n for n, _ in model.named_parameters())
    assert 0 < ddp.allreduce_s and 0 <= ddp.overlap_s <= ddp.allreduce_s
    assert 0 < ddp.forward_s < ddp.step_s and 0 < ddp.backward_s < ddp.step_s
    assert ddp.link is not None and ddp.link.bandwidth_bytes_per_s > 0 and ddp.link.latency_s >= 0
    assert ddp.peer_wait_s is not None and 0 <= ddp.peer_wait_s <= ddp.allreduce_s

    # The prior takes DDP's real buckets: the last layer's bucket is ready first.
    profile = profile_model(model, digits(32), F.cross_entropy, CPU, repeats=2)
    md = to_markdown(profile, PEAKS, ddp)
    assert "DDP at 2 process(es) (gloo), global batch 32" in md
    assert sum(line.startswith(("| 0 |", "| 1 |", "| 2 |")) for line in md.splitlines()) == len(ddp.buckets)
    emulated = emulate_buckets([(l.gradient_bytes, l.backward_s) for l in profile.layers])
    assert [b.bytes for b in emulated] == [b.bytes for b in ddp.buckets]  # the emulation agrees with DDP
    buckets = measured_buckets(ddp, [(l.name, l.backward_s) for l in profile.layers])
    assert sum(b.bytes for b in buckets) == grad_bytes(model)
    assert [b.ready_fraction for b in buckets] == sorted(b.ready_fraction for b in buckets)
    assert ProfileStepTimeModel.from_profile(profile, ddp).step_time(2) > 0


# --- the step-time prior (pure) ----------------------------------------------------------------

def synthetic_profile(batch: int, fixed: float, per_sample: float, layer_grads: list[int]) -> ModelProfile:
    """A profile whose steps are exactly affine in the batch: forward, backward, optimizer
    in proportions 1 : 2 : 0.1, with equal backward time per layer."""
    scaling = tuple(
        StepTiming(b, fixed + per_sample * b, 2 * (fixed + per_sample * b), 0.1 * fixed, 3.1 * fixed + 3 * per_sample * b)
        for b in sorted({batch, max(1, batch // 2), max(1, batch // 4)}, reverse=True)
    )
    layers = tuple(
        LayerProfile(f"l{i}", "Linear", g // 4, 0, 0, g, 0, 0, g, g, 1e-4, 2e-4) for i, g in enumerate(layer_grads)
    )
    return ModelProfile("Synthetic", "cpu", 1, batch, layers, scaling, sum(layer_grads) // 4, sum(layer_grads))


@settings(max_examples=50, deadline=None)
@given(points=st.lists(st.tuples(st.integers(1, 512), st.floats(0, 1.0)), min_size=1, max_size=5), batch=st.floats(0.5, 2048))
def test_batch_curve_passes_through_its_points_and_never_falls(points, batch):
    curve = BatchCurve.fit(points)
    assert [b for b, _ in curve.points] == sorted({b for b, _ in points})
    if len(curve.points) > 1:
        assert all(curve(b) == pytest.approx(t) for b, t in curve.points)
    assert curve(batch) >= 0 and curve(batch) <= curve(batch * 1.5) + 1e-12


def test_batch_curve_interpolates_and_extrapolates_along_the_nearest_segment():
    curve = BatchCurve.fit([(8, 1.0), (16, 1.5), (32, 3.0), (64, 7.0)])
    assert curve(24) == pytest.approx(2.25)
    assert curve(128) == pytest.approx(15.0)  # the per-sample cost of large batches
    assert curve(4) == pytest.approx(0.75)  # the fixed cost of small ones
    assert BatchCurve.fit([(64, 2.0), (32, 3.0)]).points == ((32, 3.0), (64, 3.0))  # noise cannot make more work faster


@settings(max_examples=50, deadline=None)
@given(grads=st.lists(st.integers(0, 8 * 2**20), min_size=1, max_size=12))
def test_emulated_buckets_hold_every_gradient_under_the_caps(grads):
    buckets = emulate_buckets([(g, 1.0) for g in grads], first_cap=2**20, cap=4 * 2**20)
    assert sum(b.bytes for b in buckets) == sum(grads)
    assert [b.ready_fraction for b in buckets] == sorted(b.ready_fraction for b in buckets)
    assert all(0 < b.ready_fraction <= 1 for b in buckets)
    # A bucket closes as soon as it reaches its cap, so it is over the cap by less than its last layer.
    assert all(b.bytes < (2**20 if i == 0 else 4 * 2**20) + max(grads) for i, b in enumerate(buckets[:-1]))


def test_ring_allreduce_cost():
    link = LinkParams(bandwidth_bytes_per_s=1e9, hop_latency_s=1e-5)
    assert link.allreduce_s(10**6, 1) == 0
    assert link.allreduce_s(10**6, 2) == pytest.approx(2 * 1e-5 + 1e6 / 1e9)
    assert link.allreduce_s(10**6, 4) == pytest.approx(6 * 1e-5 + 1.5 * 1e6 / 1e9)


@settings(max_examples=50, deadline=None)
@given(
    batch=st.sampled_from([8, 32, 64, 256]), fixed=st.floats(0, 1e-3), per_sample=st.floats(1e-6, 1e-4),
    grads=st.lists(st.integers(0, 4 * 2**20), min_size=1, max_size=6), devices=st.integers(1, 16), nodes=st.integers(1, 4),
)
def test_prior_properties(batch, fixed, per_sample, grads, devices, nodes):
    profile = synthetic_profile(batch, fixed, per_sample, grads)
    model = ProfileStepTimeModel.from_profile(profile, intra_node=LinkParams(10e9, 1e-5), inter_node=LinkParams(1e9, 5e-5))
    b = model.breakdown(devices, min(nodes, devices))
    assert b.per_device_batch == -(-batch // devices)
    assert b.forward_s == pytest.approx(fixed + per_sample * b.per_device_batch)
    assert 0 <= b.exposed_allreduce_s <= b.allreduce_s + 1e-12
    assert model.step_time(devices, min(nodes, devices)) == pytest.approx(b.step_s)
    if devices == 1:
        assert b.allreduce_s == 0
        assert b.step_s - b.overhead_s == pytest.approx(profile.step.forward_s + profile.step.backward_s + profile.step.optimizer_s)
    if nodes <= devices and nodes > 1:
        assert model.step_time(devices, nodes) >= model.step_time(devices, 1)  # the network is the slower link
    free = ProfileStepTimeModel.from_profile(profile, intra_node=LinkParams(float("inf"), 0.0))
    assert free.breakdown(devices).exposed_allreduce_s == 0


def test_a_bucket_ready_early_hides_behind_backward_and_a_late_one_does_not():
    def model(ready: float, efficiency: float = 1.0) -> ProfileStepTimeModel:
        return ProfileStepTimeModel(
            global_batch=2, forward=BatchCurve(((1, 0.0),)), backward=BatchCurve(((1, 10e-3), (2, 10e-3))), optimizer=BatchCurve(((1, 0.0),)),
            buckets=(Bucket(10**6, ready),), intra_node=LinkParams(1e9, 0.0), inter_node=LinkParams(1e9, 0.0), overlap_efficiency=efficiency,
        )
    # 1 MB over 2 devices at 1 GB/s: 1 ms of all-reduce.
    assert model(0.5).breakdown(2).exposed_allreduce_s == 0
    assert model(1.0).breakdown(2).exposed_allreduce_s == pytest.approx(1e-3)
    assert model(0.95).breakdown(2).exposed_allreduce_s == pytest.approx(0.5e-3)
    # Where communication takes the compute's own core, nothing hides.
    assert model(0.5, efficiency=0.0).breakdown(2).exposed_allreduce_s == pytest.approx(1e-3)
    assert model(0.5, efficiency=0.5).breakdown(2).exposed_allreduce_s == pytest.approx(0.5e-3)


def test_prior_takes_what_ddp_measured():
    profile = synthetic_profile(64, 1e-3, 1e-5, [4096, 8192])  # layers l0, l1
    buckets = (BucketProfile(0, 8192, ("l1.weight",)), BucketProfile(1, 4096, ("l0.weight",)))
    def run(world: int, link: LinkEstimate | None, allreduce_s: float) -> DdpProfile:
        return DdpProfile("m", world, "gloo", 64, 10, buckets, 12288, allreduce_s, 0.0, 1e-2, 1e-3, 1e-3, 1e-4, link)
    single = run(1, None, 4e-4)
    pair = dataclasses.replace(run(2, LinkEstimate(2, 2e9, 3e-4, ((4096, 3e-4),)), 2e-3), corun_slowdown=1.3)
    model = ProfileStepTimeModel.from_profile(profile, [single, pair])
    assert model.bucket_overhead_s == pytest.approx(2e-4)  # 0.4 ms over 2 buckets, at world size 1
    assert model.intra_node == LinkParams(2e9, 1.5e-4)  # 0.3 ms over the 2 hops of a 2-ring
    assert [b.bytes for b in model.buckets] == [8192, 4096] and [b.ready_fraction for b in model.buckets] == [0.5, 1.0]
    # Ranks sharing a node slow each other's compute; ranks on separate nodes do not.
    alone = model.forward(32)
    assert model.breakdown(2, nodes=1).forward_s == pytest.approx(1.3 * alone)
    assert model.breakdown(2, nodes=2).forward_s == pytest.approx(alone)
    assert model.breakdown(4, nodes=1).forward_s == pytest.approx(1.9 * model.forward(16))
    chosen = ProfileStepTimeModel.from_profile(profile, pair, intra_node=LinkParams(1e9, 0.0), bucket_overhead_s=0.0)
    assert chosen.intra_node == LinkParams(1e9, 0.0) and chosen.bucket_overhead_s == 0.0


def test_prior_takes_the_cost_of_all_reduces_inside_steps_and_the_wait_for_the_slowest_rank():
    profile = synthetic_profile(64, 1e-3, 1e-5, [4096, 8192])
    buckets = (BucketProfile(0, 8192, ("l1.weight",)), BucketProfile(1, 4096, ("l0.weight",)))
    link = LinkEstimate(2, 2e9, 3e-4, ((4096, 3e-4),))
    # Per step: forward 2 ms, backward 6 ms of which 2 ms all-reduce (0.7 ms waiting), optimizer 1 ms.
    run = DdpProfile("m", 2, "gloo", 64, 10, buckets, 12288, 2e-3, 0.0, 9e-3, 2e-3, 6e-3, 1e-3, link, peer_wait_s=0.7e-3)
    model = ProfileStepTimeModel.from_profile(profile, run, bucket_overhead_s=0.0)
    transfer = 2e-3 - 0.7e-3 - 12288 / 2e9  # what is left for latency: 2 buckets of 2 hops
    assert model.intra_node == LinkParams(2e9, pytest.approx(transfer / 4))
    assert model.straggler_fraction == pytest.approx(0.7e-3 / 7e-3)
    b2, b4 = model.breakdown(2), model.breakdown(4)
    assert model.breakdown(1).straggler_s == 0
    assert b2.straggler_s == pytest.approx(0.1 * (b2.forward_s + b2.backward_s + b2.optimizer_s))
    assert b4.straggler_s == pytest.approx(0.1 * (b4.forward_s + b4.backward_s + b4.optimizer_s) * 2**0.5)


def test_prior_refuses_impossible_spreads():
    model = ProfileStepTimeModel.from_profile(synthetic_profile(64, 1e-3, 1e-5, [4096]))
    with pytest.raises(ValueError):
        model.step_time(2, nodes=3)
    with pytest.raises(ValueError):
        model.step_time(0)
