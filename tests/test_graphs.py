"""CUDA graphs for static steps and batches copied ahead (training/graphs.py), and MFU (training/flops.py).

What a CPU can check: the decision (pure), the trainer's clean fallback on a CPU (trained as
before, said once in its log), the side-stream copy's order through a fake of the CUDA stream
calls, and the FLOP count against a hand count. Capture and replay themselves need a GPU
(bench/gpu_suite.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from training.config import TrialConfig
from training.flops import matmul_dtype, mfu, step_flops
from training.graphs import copied_ahead, graph_plan
from training.trainer import DistEnv, Trainer


def test_graphs_are_planned_only_for_one_static_micro_batch_on_one_gpu():
    assert graph_plan("auto", "cuda", 1, 1).capture and graph_plan("on", "cuda", 1, 1).capture
    off = {
        "off": graph_plan("off", "cuda", 1, 1),
        "cpu": graph_plan("auto", "cpu", 1, 1),
        "ddp": graph_plan("on", "cuda", 2, 1),
        "micro": graph_plan("auto", "cuda", 1, 4),
        "trace": graph_plan("auto", "cuda", 1, 1, trace=True),
    }
    assert not any(plan.capture for plan in off.values())
    assert "off" in off["off"].reason and "GPU" in off["cpu"].reason and "2 processes" in off["ddp"].reason
    assert "4 micro-batches" in off["micro"].reason and "trace" in off["trace"].reason


def test_a_setting_that_is_not_one_is_refused():
    try:
        graph_plan("yes", "cuda", 1, 1)
    except ValueError as e:
        assert "auto, on, off" in str(e)
    else:
        raise AssertionError("accepted")


def _cfg(tmp_path, **settings) -> TrialConfig:
    return TrialConfig(trial_id="g", seed=0, model={"name": "small_cnn", "width": 4}, data={"path": str(tmp_path / "d.npz")},
                       steps=6, batch_size=8, lr=0.05, log_every=3, eval_every=6, checkpoint_every=6,
                       trial_dir=str(tmp_path / "trial"), **settings)


def _train(cfg: TrialConfig) -> tuple[dict, list[float]]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(cfg, torch.device("cpu"))
        trainer.attach(DistEnv(0, 1, 0))
        result = trainer.train()
        weights = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
        trainer.detach()
        trainer.close()
    finally:
        dist.destroy_process_group()
    return result, weights


def test_on_a_cpu_every_setting_trains_the_same_and_says_once_why_there_is_no_graph(tmp_path, capsys, digits_npz):
    import shutil

    runs = {}
    for setting in ("off", "on", "auto"):
        folder = tmp_path / setting
        folder.mkdir()
        shutil.copy(digits_npz, folder / "d.npz")
        capsys.readouterr()
        runs[setting] = _train(_cfg(folder, cuda_graphs=setting))
        said = [line for line in capsys.readouterr().out.splitlines() if "cuda_graphs" in line]
        assert len(said) == 1, said
        assert ("training.cuda_graphs is off" in said[0]) if setting == "off" else ("CUDA graphs need a GPU" in said[0])
        assert said[0].startswith("warning:") == (setting == "on")  # asked for, not given: a warning, not a failure
        assert runs[setting][0]["steps"] == 6 and "mfu" not in runs[setting][0]["metrics"]  # no MFU on a CPU slot
    assert runs["off"][1] == runs["on"][1] == runs["auto"][1]


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")


class FakeStreams:
    """The CUDA stream calls of `copied_ahead`, recorded in order with the copies and the steps."""

    def __init__(self):
        self.log: list[str] = []
        self.copy, self.step = FakeStream("copy", self.log), FakeStream("step", self.log)
        self.using = self.step

    def side(self):
        return self.copy

    def current(self):
        return self.step

    def on(self, stream):
        streams = self

        class Using:
            def __enter__(self):
                streams.using = stream

            def __exit__(self, *exc):
                streams.using = streams.step

        return Using()

    def record(self, tensor, stream) -> None:
        self.log.append(f"batch {int(tensor.flatten()[0])} used by {stream.name}")


def test_each_batch_is_copied_on_the_side_stream_before_the_step_before_it_runs():
    streams = FakeStreams()

    def host_batches():
        for i in range(3):
            streams.log.append(f"load {i}")
            yield torch.full((2,), i), torch.full((2,), i)

    for x, y in copied_ahead(host_batches(), torch.device("cpu"), streams):
        streams.log.append(f"step {int(x[0])}")
    log = streams.log
    # batch n+1 is loaded (and its copy queued) before step n runs; each step waits for the copy
    assert log.index("load 1") < log.index("step 0") and log.index("load 2") < log.index("step 1")
    assert log.index("step waits for copy") < log.index("step 0")
    assert log.count("step waits for copy") == 3 and log.count("batch 1 used by step") == 2  # x and y
    assert [line for line in log if line.startswith("step ") and "waits" not in line] == ["step 0", "step 1", "step 2"]


def test_the_flop_count_of_a_linear_model_is_the_hand_count():
    # Linear(8 -> 4) on 16 samples: forward 2*16*8*4 = 1024 (the bias add is not a matmul FLOP),
    # backward: the weight's gradient 2*16*8*4 = 1024; the input needs no gradient: none for it.
    model = nn.Linear(8, 4)
    objective = lambda m, x, y: nn.functional.mse_loss(m(x), y)  # noqa: E731
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    assert step_flops(lambda: nn.Linear(8, 4), objective, x, y) == 2048
    before = [p.clone() for p in model.parameters()]
    assert step_flops(lambda: (_ for _ in ()).throw(RuntimeError("no meta")), objective, x, y, model=model) == 2048
    assert all(torch.equal(a, b) and b.grad is None for a, b in zip(before, model.parameters()))  # counted on a copy
    # a step of 2048 FLOPs every millisecond on a 1 GFLOP/s peak: 2048 / 1e-3 / 1e9
    assert abs(mfu(2048, 1e-3, 1e9) - 0.002048) < 1e-12
    assert matmul_dtype("bf16") is torch.bfloat16 and matmul_dtype("fp32") is torch.float32


def test_a_process_attached_at_another_size_counts_the_flops_of_its_own_samples(tmp_path, digits_npz):
    """MFU's FLOPs are counted once (a GPU's rank 0, at its first step) per sample; a resize
    changes how many samples a process trains per step, so each attach scales them to its own."""
    import shutil

    shutil.copy(digits_npz, tmp_path / "d.npz")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(_cfg(tmp_path, logical_ranks=2), torch.device("cpu"))
        trainer.flops_per_sample = 1000.0  # as a GPU's rank 0 measured it at an earlier size
        trainer.attach(DistEnv(0, 1, 0))
        assert sum(s.size for s in trainer.spans) == 8 and trainer.flops_per_step == 8000.0  # the whole batch here
        trainer.detach()
        trainer.close()
    finally:
        dist.destroy_process_group()
