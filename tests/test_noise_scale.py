"""The gradient noise scale (training.noise_scale): the estimator recovers a known noise scale
from synthetic gradients, and the trainer measures and logs it without changing a bit of
the training result (2 processes through DDP's comm hook, 1 process from its micro-batches,
exact reduction from its logical ranks' slots)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.config import TrialConfig
from training.noise_scale import NoiseScale, decay_for, harmonic_mean, squared_norm


def regression_problem(n: int = 4000, dim: int = 20, seed: int = 0):
    """Per-sample gradients of ½(wᵀx − y)² at a fixed w, and the exact noise scale of
    sampling them with replacement: tr(Σ) / |G|² over this population."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    w_true = torch.randn(dim, generator=g, dtype=torch.float64)
    y = x @ w_true + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    w = w_true + 0.3 * torch.randn(dim, generator=g, dtype=torch.float64)  # away from the optimum: |G| > 0
    per_sample = (x @ w - y)[:, None] * x  # ∇_w ½(wᵀx − y)², one row per sample
    mean = per_sample.mean(0)
    trace = ((per_sample - mean) ** 2).sum(1).mean()  # tr(Σ), the population covariance
    return per_sample, float(trace / mean.square().sum())


def measure(per_sample: torch.Tensor, small_sizes: list[int], steps: int, seed: int = 1) -> NoiseScale:
    """Each step: a batch of sum(small_sizes) samples drawn with replacement, split into the
    small batches (as processes or micro-batches split a step); |g_small|² is their mean."""
    g = torch.Generator().manual_seed(seed)
    b_big = sum(small_sizes)
    estimator = NoiseScale(torch.device("cpu"), decay=decay_for(1, horizon=steps / 3))
    for _ in range(steps):
        batch = per_sample[torch.randint(len(per_sample), (b_big,), generator=g)]
        parts = torch.split(batch, small_sizes)
        small_sq = torch.stack([p.mean(0).square().sum() for p in parts]).mean()
        estimator.update(small_sq, harmonic_mean(small_sizes), batch.mean(0).square().sum(), b_big)
    return estimator


def test_estimator_recovers_a_known_noise_scale():
    per_sample, truth = regression_problem()
    assert 10 < truth < 1000, truth  # a noise scale in the range a real workload has
    value = measure(per_sample, [8, 8, 8, 8], steps=3000).value()
    assert value == pytest.approx(truth, rel=0.15), (value, truth)


def test_uneven_small_batches_use_their_harmonic_mean():
    per_sample, truth = regression_problem(seed=2)
    value = measure(per_sample, [3, 13], steps=3000).value()
    assert value == pytest.approx(truth, rel=0.15), (value, truth)


def test_no_estimate_without_measurements_or_signal():
    estimator = NoiseScale(torch.device("cpu"))
    assert estimator.value() is None and estimator.moments() is None
    # |g_big|² far below |g_small|²: noise only, the |G|² estimate is negative, no noise scale.
    estimator.update(torch.tensor(1.0), 8, torch.tensor(0.1), 16)
    assert estimator.value() is None
    with pytest.raises(ValueError):
        estimator.update(torch.tensor(1.0), 16, torch.tensor(1.0), 16)


def test_non_finite_measurement_is_skipped_on_the_device():
    estimator = NoiseScale(torch.device("cpu"))
    estimator.update(torch.tensor(3.0), 8, torch.tensor(1.0), 32, check_finite=True)
    before = estimator.state.clone()
    estimator.update(torch.tensor(math.inf), 8, torch.tensor(1.0), 32, check_finite=True)  # an fp16 overflow
    assert torch.equal(estimator.state, before)
    # |G|² = (32·1 − 8·3)/24 = 1/3, tr(Σ) = (3 − 1)/(1/8 − 1/32) = 64/3: B = 64.
    assert estimator.value() == pytest.approx(64.0)


def test_deferred_measurement_is_applied_in_order_and_state_round_trips():
    class Work:
        waited = False

        def wait(self):
            self.waited = True

    direct, deferred = NoiseScale(torch.device("cpu"), 0.5), NoiseScale(torch.device("cpu"), 0.5)
    samples = [(3.0, 1.0), (5.0, 2.0), (4.0, 1.5)]
    for small, big in samples:
        direct.update(torch.tensor(small), 8, torch.tensor(big), 32)
    work = Work()
    deferred.update(torch.tensor(samples[0][0]), 8, torch.tensor(samples[0][1]), 32)
    deferred.update(torch.tensor(samples[1][0]), 8, torch.tensor(samples[1][1]), 32, after=work)
    assert not work.waited
    deferred.update(torch.tensor(samples[2][0]), 8, torch.tensor(samples[2][1]), 32)
    assert work.waited
    assert deferred.moments() == pytest.approx(direct.moments())
    copy = NoiseScale(torch.device("cpu"), 0.5)
    copy.load_state_dict(deferred.state_dict())
    assert copy.value() == pytest.approx(direct.value())


def test_squared_norm():
    tensors = [torch.tensor([3.0, 4.0]), None, torch.tensor([[1.0], [2.0]])]
    assert float(squared_norm(tensors)) == pytest.approx(30.0)


# --- end to end: torchrun --------------------------------------------------------------
def trial(trial_dir: Path, digits: Path, **overrides) -> TrialConfig:
    base = dict(trial_id=trial_dir.name, seed=5, model={"name": "small_cnn", "width": 8, "dropout": 0.1},
                data={"path": str(digits)}, logical_ranks=2, steps=40, batch_size=32, lr=0.05, warmup_steps=5,
                checkpoint_every=1000, eval_every=1000, log_every=10, trial_dir=str(trial_dir))
    return TrialConfig(**{**base, **overrides})


def run_to_end(cfg: TrialConfig, processes: int) -> dict:
    Path(cfg.trial_dir).mkdir(parents=True, exist_ok=True)
    path = Path(cfg.trial_dir) / "trial.json"
    path.write_text(cfg.to_json())
    cmd = [sys.executable, "-m", "training.launch", "--standalone", f"--nproc-per-node={processes}", "-m", "training.train",
           "--config", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return json.loads(Path(cfg.result_path).read_text())


def final_weights(cfg: TrialConfig, result: dict) -> dict[str, torch.Tensor]:
    from training.checkpoint import load_model_weights
    from training.workload import build_model

    return load_model_weights(Path(result["checkpoint"]), build_model(cfg.model)).state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("processes, reduction", [(2, "fast"), (1, "fast"), (2, "exact")])
def test_trainer_logs_noise_scale_and_trains_the_same_bits(tmp_path, digits_npz, processes, reduction):
    measured = trial(tmp_path / "measured", digits_npz, reduction=reduction)  # default: the step before each log step
    plain = trial(tmp_path / "plain", digits_npz, reduction=reduction, noise_scale_every=0)
    with_noise, without = run_to_end(measured, processes), run_to_end(plain, processes)

    noise = with_noise["metrics"]["grad_noise_scale"]
    assert math.isfinite(noise) and noise > 0, noise
    progress = json.loads(Path(measured.progress_path).read_text())
    assert progress["metrics"]["grad_noise_scale"] == noise  # what the scheduler reads
    assert "grad_noise_scale" not in without["metrics"]

    a, b = final_weights(measured, with_noise), final_weights(plain, without)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs by {(a[name] - b[name]).abs().max()}"
    assert with_noise["metrics"]["train_loss"] == without["metrics"]["train_loss"]


@pytest.mark.slow
def test_one_batch_size_gives_no_estimate(tmp_path, digits_npz):
    # One process, one logical rank, no micro-batches: nothing to compare, nothing made up.
    result = run_to_end(trial(tmp_path / "single", digits_npz, logical_ranks=1), 1)
    assert "grad_noise_scale" not in result["metrics"]
