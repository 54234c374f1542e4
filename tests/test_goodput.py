"""`scaling: goodput`: an elastic trial's batch and learning rate follow its size.

Real elastic trials (agent + workers, gloo on CPU slots). What must hold across a resize:
every sample of the global order is trained exactly once, in order (the data position is
counted in samples, not steps); each size trains its own batch (each process keeps its
share) with the learning rate scaled to it; the trial ends after steps x batch_size
samples; and the resize's batch and learning rate are on the trial's record.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from elastic_helpers import finish, resize, resizes, start, trace, trial_config
from training.batch_choice import batch_choice_now
from training.config import TrialConfig
from training.data import SampleOrder, load_digits_npz
from training.trainer import lr_factor
from training.layout import trial_files

pytestmark = pytest.mark.slow  # real elastic trials


def resized_at_hold(cfg: TrialConfig, mode: str, chosen_batch: int | None = None) -> None:
    """Start `cfg` on 2 processes, held at its hold step; ask for 1 (at `chosen_batch`, as the
    campaign's scheduler writes it, if given); let it go on to the end."""
    hold = trial_files(cfg.trial_dir).hold
    hold.parent.mkdir(parents=True, exist_ok=True)
    hold.touch()
    proc = start(cfg, 2)
    deadline = time.time() + 120
    while (json.loads(cfg.progress_path.read_text()) if cfg.progress_path.exists() else {}).get("state") != "held":
        assert proc.poll() is None and time.time() < deadline, (Path(cfg.trial_dir) / "agent.log").read_text()[-2000:]
        time.sleep(0.02)
    if chosen_batch is not None:
        batch_choice_now(1, chosen_batch, chosen_batch / cfg.batch_size).write(cfg.trial_dir)
    resize(cfg, 1, 1, mode)
    hold.unlink()
    finish(proc, cfg)


def test_batch_and_learning_rate_at_each_size():
    cfg = TrialConfig(trial_id="t", seed=0, model={}, data={}, steps=100, batch_size=64, lr=0.1, logical_ranks=4,
                      scaling="goodput")
    assert [cfg.batch_at(w) for w in (1, 2, 3, 4)] == [16, 32, 48, 64]  # each process keeps its 16
    assert cfg.lr_scale(32) == 0.5 and cfg.total_samples == 6400
    assert TrialConfig(**{**json.loads(cfg.to_json()), "lr_scaling": "sqrt"}).lr_scale(16) == 0.5
    fixed = TrialConfig(**{**json.loads(cfg.to_json()), "scaling": "reproducible"})
    assert [fixed.batch_at(w) for w in (1, 2, 4)] == [64, 64, 64]


@pytest.mark.parametrize("mode", ["resize", "restart"])  # state through memory, or through the checkpoint on disk
def test_resized_goodput_trial_trains_every_sample_once_at_each_sizes_batch(tmp_path, digits_npz, mode):
    cfg = trial_config(tmp_path / mode, digits_npz, steps=240, scaling="goodput", warmup_steps=0, hold_at_step=60)  # batch 30 at 2
    resized_at_hold(cfg, mode)

    result = json.loads(Path(cfg.result_path).read_text())
    assert result["scaling"] == "goodput" and result["samples_seen"] == cfg.total_samples == 240 * 30

    # Each step's batch is its size's: 30 at 2 processes, then 15 at 1; together they are the
    # global order's first steps x batch_size samples, each once.
    steps = trace(cfg)
    sizes = [len(steps[s][0]) for s in sorted(steps)]
    switch = sizes.index(15)
    assert set(sizes[:switch]) == {30} and set(sizes[switch:]) == {15} and switch >= 60
    assert sorted(steps) == list(range(len(sizes))) and len(sizes) == result["steps"]
    trained = np.concatenate([steps[s][0] for s in sorted(steps)])
    order = SampleOrder(len(load_digits_npz(digits_npz).train_y), cfg.seed)
    assert np.array_equal(trained, order.batch_at(0, cfg.total_samples))

    # The resize is on the record: the new batch and its learning rate (linear scaling: half,
    # times the cosine schedule at the samples trained so far).
    (event,) = resizes(cfg)
    assert event["batch_size"] == 15 and event["samples_seen"] == switch * 30
    expected_lr = cfg.lr * 0.5 * lr_factor("cosine", 0, cfg.total_samples, event["samples_seen"])
    assert math.isclose(event["lr"], expected_lr, rel_tol=1e-6)
    log = (Path(cfg.trial_dir) / "agent.log").read_text()
    assert "batch 15, lr" in log


def test_reproducible_trial_keeps_its_batch_through_the_same_resize(tmp_path, digits_npz):
    cfg = trial_config(tmp_path / "fixed", digits_npz, steps=240, warmup_steps=0, hold_at_step=60)
    resized_at_hold(cfg, "resize")
    steps = trace(cfg)
    assert {len(samples) for samples, _ in steps.values()} == {30} and len(steps) == 240
    (event,) = resizes(cfg)
    assert event["batch_size"] == 30 and event["samples_seen"] % 30 == 0
    assert math.isclose(event["lr"], cfg.lr * lr_factor("cosine", 0, cfg.steps, event["samples_seen"] // 30), rel_tol=1e-6)


def test_a_goodput_trial_trains_its_next_size_at_the_batch_the_scheduler_chose(tmp_path, digits_npz):
    """With max_batch_size, the batch at a size is the scheduler's choice for goodput (here
    45 at one process, where it would follow the size to 15), within [batch_at, max]; every
    sample is still trained once, and the learning rate follows that batch."""
    cfg = trial_config(tmp_path / "chosen", digits_npz, steps=120, scaling="goodput", warmup_steps=0, hold_at_step=30,
                       max_batch_size=45)
    assert cfg.chosen_batch(1, 200) == 45 and cfg.chosen_batch(1, 3) == 15 and cfg.chosen_batch(2, None) == 30
    resized_at_hold(cfg, "resize", chosen_batch=45)

    steps = trace(cfg)
    sizes = [len(steps[s][0]) for s in sorted(steps)]
    switch = sizes.index(45)
    assert set(sizes[:switch]) == {30} and set(sizes[switch:]) == {45} and switch >= 30
    trained = np.concatenate([steps[s][0] for s in sorted(steps)])
    order = SampleOrder(len(load_digits_npz(digits_npz).train_y), cfg.seed)
    # The samples of the global order, each once, in order; a batch that does not divide the
    # samples left ends up to one batch past steps x batch_size (the order goes on there).
    assert cfg.total_samples <= len(trained) < cfg.total_samples + 45
    assert np.array_equal(trained, order.batch_at(0, len(trained)))
    (event,) = resizes(cfg)
    assert event["batch_size"] == 45
    expected_lr = cfg.lr * 1.5 * lr_factor("cosine", 0, cfg.total_samples, event["samples_seen"])
    assert math.isclose(event["lr"], expected_lr, rel_tol=1e-6)
