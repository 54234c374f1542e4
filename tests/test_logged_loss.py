"""The training loss a trial logs is the whole batch's mean, not rank 0's share of it.

A trial's `train_loss` curve is what researchers compare across trials of different sizes and
across a trial's resizes. Each process sums its logical ranks' losses; at a log step the sums
meet across processes (training.trainer.LossSums). In `reduction: exact` the curve is then the
same bits at any number of processes; in `fast` it agrees to float rounding.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from training.config import TrialConfig

pytestmark = pytest.mark.slow  # torchrun, three times


def logged_loss(tmp_path: Path, digits: Path, processes: int, reduction: str) -> list[tuple[int, float]]:
    """(step, train_loss) as MLflow holds them after a 40-step trial on `processes` processes."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("loss") or client.get_experiment(client.create_experiment("loss"))
    run_id = client.create_run(experiment.experiment_id).info.run_id
    trial_dir = tmp_path / f"{reduction}-{processes}"
    cfg = TrialConfig(trial_id=trial_dir.name, seed=5, model={"name": "small_cnn", "width": 8, "dropout": 0.1},
                      data={"path": str(digits)}, logical_ranks=4, reduction=reduction, steps=40, batch_size=32, lr=0.05,
                      warmup_steps=5, checkpoint_every=1000, eval_every=1000, log_every=10, trial_dir=str(trial_dir),
                      mlflow_tracking_uri=uri, mlflow_run_id=run_id)
    trial_dir.mkdir(parents=True)
    (trial_dir / "trial.json").write_text(cfg.to_json())
    done = subprocess.run([sys.executable, "-m", "training.launch", "--standalone", f"--nproc-per-node={processes}",
                           "-m", "training.train", "--config", str(trial_dir / "trial.json")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train_loss"))


def test_the_logged_loss_is_the_whole_batchs_at_any_number_of_processes(tmp_path, digits_npz):
    one = logged_loss(tmp_path, digits_npz, 1, "exact")  # one process runs all four logical ranks
    assert [step for step, _ in one] == [10, 20, 30, 40]
    assert logged_loss(tmp_path, digits_npz, 2, "exact") == one  # the same bits, not rank 0's half

    fast = dict(logged_loss(tmp_path, digits_npz, 2, "fast"))
    for step, loss in one:  # DDP's order of additions: rounding only (rank 0's half differed by ~1e-2)
        assert fast[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), (step, fast[step], loss)



def test_a_resized_trials_curve_is_an_uninterrupted_ones_bit_for_bit(tmp_path, digits_npz):
    """Stops for resizes (and checkpoints) cut log windows: the window a stop cuts goes on in
    the next generation, through memory or a checkpoint, so each logged value is the mean of
    the same steps as in an uninterrupted run: in `reduction: exact`, the same bits."""
    from elastic_helpers import finish, resizes, run, trial_config

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("resized")
    curves = {}
    # (processes at the start, the resize at step 150 or none, how): the state moves to a
    # joiner through memory (grown), stays in memory (shrunk), or goes through a checkpoint.
    for name, devices, plan, mode in (("fixed", 2, [], "resize"), ("grown", 1, [(150, 2)], "resize"),
                                      ("shrunk", 2, [(150, 1)], "resize"), ("restarted", 2, [(150, 2)], "restart")):
        run_id = client.create_run(experiment).info.run_id
        # log_every 7: no stop step (two control steps after a multiple of 5) and no checkpoint
        # step (100, 200) is a log step, so each stop and checkpoint cuts a window.
        cfg = trial_config(tmp_path / name, digits_npz, steps=300, reduction="exact", log_every=7, trace=False,
                           hold_at_step=150 if plan else None, mlflow_tracking_uri=uri, mlflow_run_id=run_id)
        finish(run(cfg, devices, plan, mode=mode), cfg)
        assert len(resizes(cfg)) == len(plan)
        assert all(event["step"] % 7 for event in resizes(cfg)), resizes(cfg)
        curves[name] = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train_loss"))
    assert [step for step, _ in curves["fixed"]] == [*range(7, 300, 7), 300]
    for name in ("grown", "shrunk", "restarted"):
        assert curves[name] == curves["fixed"], name
