"""Bring your own workload: a user's model (BatchNorm + nn.Dropout) and map-style dataset,
checked before anything runs, trained by torchrun like a built-in, resumable bit for bit,
and schedule-independent through logical ranks."""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient

from training.checkpoint import load_model_weights
from training.config import TrialConfig
from training.manifest import list_checkpoints
from training.workload import WorkloadError, build_model, check_workload
from user_workload import PACKAGE, workload, write_package
from training.layout import trial_files

SGD = {"name": "SGD", "kwargs": {"momentum": 0.9}}
CE = {"name": "cross_entropy"}


@pytest.fixture(scope="session")
def user_root(tmp_path_factory) -> Path:
    return write_package(tmp_path_factory.mktemp("lab"))


def check(model: dict, data: dict, loss: dict = CE, optimizer: dict = SGD):
    return check_workload(model=model, data=data, loss=loss, optimizer=optimizer, lr=0.1)


def test_a_good_workload_is_checked_on_real_samples(user_root, digits_npz, monkeypatch):
    monkeypatch.chdir(user_root)  # the campaign's directory: its packages are importable
    work = workload(digits_npz)
    found = check(work["model"], work["data"])
    assert found.input_shape == (1, 8, 8) and found.output_shape == (10,)
    assert found.train_samples > 1000 and found.val_samples > 300


def test_a_workload_that_passed_is_not_built_again_until_its_code_or_data_changes(tmp_path, digits_npz, monkeypatch):
    """`campaign launch` checks each workload before anything runs; a workload that passed
    with the same code, data and torch is not rebuilt (no torch import on a relaunch)."""
    import training.workload
    from tasks.grid import expand_grid
    from tasks.workload import CHECK_CACHE_ENV, check_trials
    from training.spec import parse_spec

    monkeypatch.setenv(CHECK_CACHE_ENV, str(tmp_path / "cache"))
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    (project / "helpers.py").write_text("X = 1\n")
    built = []
    real = training.workload.check_workload
    monkeypatch.setattr(training.workload, "check_workload", lambda **kw: built.append(kw["model"]) or real(**kw))

    def spec(width: int):
        return parse_spec({"campaign": {"name": "c"}, "data": {"path": str(digits_npz)}, "model": {"name": "mlp", "width": width},
                           "training": {"steps": 2, "batch_size": 8, "lr": 0.1}})

    check_trials(expand_grid(spec(8)))
    check_trials(expand_grid(spec(8)))
    assert len(built) == 1  # the second launch found it passed
    check_trials(expand_grid(spec(16)))
    assert len(built) == 2  # another workload is checked
    (project / "helpers.py").write_text("X = 22\n")  # an edit in the campaign's folder: checked again
    check_trials(expand_grid(spec(8)))
    assert len(built) == 3
    os.utime(digits_npz)  # the data file changed (its time): checked again
    check_trials(expand_grid(spec(8)))
    assert len(built) == 4

    # A workload that fails is never remembered: it fails again, naming the field.
    monkeypatch.setattr(training.workload, "check_workload", lambda **kw: built.append(kw["model"]) or (_ for _ in ()).throw(WorkloadError("model: broken")))
    for _ in range(2):
        with pytest.raises(WorkloadError, match="model: broken"):
            check_trials(expand_grid(spec(32)))
    assert len(built) == 6


BAD_TARGETS = [
    # (what to change, words the error must contain)
    ({"model": {"target": "nosuchpkg.nets:make"}}, ["model.target", "cannot import 'nosuchpkg.nets'", "importable from"]),
    ({"model": {"target": f"{PACKAGE}.nets:missing"}}, ["model.target", "has no attribute 'missing'"]),
    ({"model": {"target": f"{PACKAGE}.nets:make", "kwargs": {"depth": 3}}}, ["model.kwargs", "does not accept ['depth']"]),
    ({"model": {"target": f"{PACKAGE}.nets:not_a_module"}}, ["model.target", "returned a str, not a torch.nn.Module"]),
    ({"model": {"target": f"{PACKAGE}.nets:wrong_input"}}, ["model:", "forward pass", "do not fit"]),
    ({"data": {"target": f"{PACKAGE}.data:only_one"}}, ["data.target", "must return (train, val)"]),
    ({"data": {"target": f"{PACKAGE}.data:dict_items"}}, ["data:", "must be a pair (input, target)"]),
    ({"data": {"target": f"{PACKAGE}.data:make", "kwargs": {"path": "/nonexistent.npz"}}}, ["data:", "FileNotFoundError"]),
    ({"loss": {"target": "torch.nn.functional:mse_loss"}}, ["loss:", "raised"]),
    ({"loss": {"target": "torch.nn:CrossEntropyLoss", "kwargs": {"smoothing": 0.1}}}, ["loss.kwargs", "does not accept ['smoothing']"]),
    ({"optimizer": {"name": "Adamm"}}, ["optimizer.name", "'Adamm' is not a torch.optim optimizer", "AdamW"]),
    ({"optimizer": {"name": "AdamW", "kwargs": {"momentum": 0.9}}}, ["optimizer.kwargs", "does not accept ['momentum']"]),
]


@pytest.mark.parametrize("change,words", BAD_TARGETS, ids=[str(c)[:60] for c, _ in BAD_TARGETS])
def test_bad_targets_name_the_field(user_root, digits_npz, monkeypatch, change, words):
    monkeypatch.chdir(user_root)
    parts = {**workload(digits_npz), "loss": CE, "optimizer": SGD}
    for key, value in change.items():
        if key == "data" and "kwargs" not in value:
            value = {**value, "kwargs": {"path": str(digits_npz)}}
        parts[key] = value
    with pytest.raises(WorkloadError) as info:
        check(**parts)
    for word in words:
        assert word in str(info.value), str(info.value)


def campaign_params(root: Path, digits: Path, **changes) -> Path:
    work = workload(digits)
    raw = {
        "campaign": {"name": "byo"},
        "model": work["model"], "data": work["data"],
        "optimizer": {"name": "AdamW", "kwargs": {"weight_decay": 0.01}},
        "training": {"steps": 40, "batch_size": 32, "lr": 0.003, "warmup_steps": 5, "checkpoint_every": 20,
                     "eval_every": 20, "grad_clip_norm": 1.0},
        "grid": {"model.kwargs.p": [0.1, 0.3]},
        "resources": {"devices": 2},
        "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{root}/mlflow.db", "experiment": "byo", "runs_dir": str(root / "runs"),
                     "summary": str(root / "summary.json")},
    }
    raw.update(changes)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_cli_refuses_a_bad_target_before_anything_runs(tmp_path, user_root, digits_npz):
    from conftest import campaign_cli

    write_package(tmp_path)
    campaign_params(tmp_path, digits_npz, model={"target": f"{PACKAGE}.nets:make", "kwargs": {"depth": 3}})
    result = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert "model.kwargs" in output and "does not accept ['depth']" in output
    assert sorted(p.name for p in tmp_path.iterdir()) == [PACKAGE, "params.yaml"]  # nothing half-written


def test_cli_refuses_labels_outside_the_models_outputs_before_anything_runs(tmp_path, user_root, digits_npz):
    """A model with 5 outputs on digits (labels 0..9): the first two samples' labels fit, the
    data's do not; without the check every trial failed at step 0."""
    from conftest import campaign_cli

    write_package(tmp_path)
    campaign_params(tmp_path, digits_npz, model={"target": f"{PACKAGE}.nets:five_classes", "kwargs": {"width": 8}},
                    grid={"training.lr": [0.003]})
    result = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert "data/model" in output and "label 9" in output and "5 outputs" in output, output
    assert sorted(p.name for p in tmp_path.iterdir()) == [PACKAGE, "params.yaml"]  # nothing ran


@pytest.mark.slow
def test_user_workload_runs_through_campaign_launch(tmp_path, user_root, digits_npz, monkeypatch):
    """The user's package sits in the campaign's directory, as a researcher's would. Its
    trials (torchrun's, with loader workers from a fork server) leave no temporary folder:
    torchrun's log folder and the fork server's went on every trial start."""
    from conftest import campaign_cli
    from mlflow import MlflowClient

    write_package(tmp_path)
    campaign_params(tmp_path, digits_npz)
    temporary = Path(tempfile.mkdtemp(prefix="t"))  # short: sockets are made under it
    monkeypatch.setenv("TMPDIR", str(temporary))
    try:
        result = campaign_cli("launch", "params.yaml", cwd=tmp_path)
        left = sorted(p.name for p in temporary.iterdir() if p.name.startswith(("torchelastic_", "pymp-")))
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not left, f"left in TMPDIR: {left}"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["finished"] == 2 and summary["failed"] == 0
    for metrics in (json.loads(p.read_text()) for p in (tmp_path / "summary-trials").iterdir()):
        assert 0.5 < metrics["val_accuracy"] <= 1.0  # 40 AdamW steps of a small CNN learn digits
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("byo").experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)


# --- torchrun directly: the trainer on the user's workload --------------------------------

def config(trial_dir: Path, digits: Path, **overrides) -> TrialConfig:
    base = dict(trial_id=trial_dir.name, seed=3, **workload(digits), steps=60, batch_size=32, lr=0.05, warmup_steps=5,
                checkpoint_every=20, eval_every=60, logical_ranks=2, trial_dir=str(trial_dir))
    return TrialConfig(**{**base, **overrides})


def launch(cfg: TrialConfig, processes: int, cwd: Path) -> subprocess.Popen:
    Path(cfg.trial_dir).mkdir(parents=True, exist_ok=True)
    path = Path(cfg.trial_dir) / "trial.json"
    path.write_text(cfg.to_json())
    cmd = [sys.executable, "-m", "training.launch", "--standalone", f"--nproc-per-node={processes}",
           "-m", "training.train", "--config", str(path)]
    log = open(Path(cfg.trial_dir) / "train.log", "ab")
    return subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def run(cfg: TrialConfig, processes: int, cwd: Path) -> dict[str, torch.Tensor]:
    proc = launch(cfg, processes, cwd)
    assert proc.wait(timeout=300) == 0, (Path(cfg.trial_dir) / "train.log").read_text()[-3000:]
    return weights(cfg, cwd)


def weights(cfg: TrialConfig, cwd: Path) -> dict[str, torch.Tensor]:
    result = json.loads(Path(cfg.result_path).read_text())
    old = os.getcwd()
    os.chdir(cwd)
    try:
        model = build_model(cfg.model)
    finally:
        os.chdir(old)
    return load_model_weights(Path(result["checkpoint"]), model).state_dict()


def largest_difference(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.slow
def test_user_model_killed_and_resumed_matches_an_uninterrupted_run(tmp_path, user_root, digits_npz):
    straight = run(config(tmp_path / "straight", digits_npz), 2, user_root)

    # The killed trial logs to MLflow: the steps it replays after resuming are not logged twice.
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("replay")).info.run_id
    held = config(tmp_path / "killed", digits_npz, hold_at_step=50, log_every=5, mlflow_tracking_uri=uri, mlflow_run_id=run_id)
    Path(held.trial_dir).mkdir(parents=True)
    trial_files(held.trial_dir).hold.touch()  # the trainer waits before step 50: the kill lands there
    proc = launch(held, 2, user_root)
    try:
        deadline = time.time() + 120
        while json.loads((Path(held.progress_path).read_text() if Path(held.progress_path).exists() else "{}") or "{}").get("state") != "held":
            assert proc.poll() is None, (Path(held.trial_dir) / "train.log").read_text()[-3000:]
            assert time.time() < deadline, "the trial never reached its hold step"
            time.sleep(0.05)
        while max([m.step for m in client.get_metric_history(run_id, "train_loss")], default=0) < 45:  # the sink flushed step 45
            assert time.time() < deadline, "step 45 never reached MLflow"
            time.sleep(0.2)
    finally:  # killed here as the test intends, and also when a wait above fails: nothing left running
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert [p.name for p in list_checkpoints(held.checkpoint_dir)] == ["step-00000040", "step-00000020"]
    assert not Path(held.result_path).exists()

    trial_files(held.trial_dir).hold.unlink()
    resumed = run(held, 2, user_root)
    assert "resumed at step 40" in (Path(held.trial_dir) / "train.log").read_text()
    assert straight.keys() == resumed.keys() and any("running_mean" in k for k in straight)
    for name in straight:  # weights, BatchNorm statistics, all: bit for bit
        assert torch.equal(straight[name], resumed[name]), name
    steps = [m.step for m in client.get_metric_history(run_id, "train_loss")]
    assert sorted(steps) == list(range(5, 61, 5)), steps  # 45, logged before the kill and replayed after it: once


@pytest.mark.slow
def test_logical_ranks_make_dropout_and_batchnorm_independent_of_the_process_count(tmp_path, user_root, digits_npz):
    two = run(config(tmp_path / "two", digits_npz), 2, user_root)
    one = run(config(tmp_path / "one", digits_npz), 1, user_root)  # both logical ranks on one process
    width_one = run(config(tmp_path / "width1", digits_npz, logical_ranks=1), 1, user_root)  # another experiment
    same = largest_difference(two, one)
    other = largest_difference(two, width_one)
    # Only the order of float additions differs (one process sums what two all-reduce).
    assert same < 1e-4, same
    assert other > 100 * max(same, 1e-7), (same, other)  # other masks, other BatchNorm batches: another result
    running = [k for k in two if "running_mean" in k]
    assert running and all(torch.allclose(two[k], one[k], atol=1e-5) for k in running)


@pytest.mark.slow
def test_precision_and_micro_batches_train(tmp_path, user_root, digits_npz):
    """bf16 autocast with micro-batches of 4 (gradient accumulation) trains to a sane result."""
    cfg = replace(config(tmp_path / "bf16", digits_npz), precision="bf16", max_device_batch=4, steps=30, eval_every=30)
    run(cfg, 1, user_root)
    result = json.loads(Path(cfg.result_path).read_text())
    assert result["metrics"]["val_accuracy"] > 0.3 and result["steps"] == 30


@pytest.mark.parametrize("example", ["resnet", "chargpt"])
def test_the_examples_are_checked_workloads(example, monkeypatch):
    """Each example spec builds and trains a step on its real data (the pre-flight check)."""
    from conftest import REPO
    from training.spec import load_spec
    from tasks.grid import expand_grid
    from tasks.workload import check_trials

    monkeypatch.chdir(REPO)  # targets are `examples.workloads...`, imported from the launch directory
    spec = load_spec(REPO / "examples" / f"{example}.yaml")
    trials = expand_grid(spec)
    assert len(trials) == 2 and spec.model.target.startswith("examples.workloads.")
    check_trials(trials)


@pytest.mark.slow
def test_exact_reduction_is_bit_for_bit_through_resizes_and_preemption(tmp_path, user_root, digits_npz, monkeypatch):
    """BatchNorm + nn.Dropout, resized 2 -> 1 -> 2 and preempted at 2 then resumed at 1: every
    step's loss and the final weights equal a fixed 2-process run's exactly."""
    from elastic_helpers import (finish, final_weights, hold, release_when_asked_to_stop, resizes, run as run_elastic, start,
                                 stop_requests, trace, trial_config, wait_for_step)
    from training.elastic import PREEMPTED
    from training.agent_commands import write_command

    monkeypatch.setenv("PYTHONPATH", f"{user_root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")  # the agent's workers import it
    monkeypatch.chdir(user_root)
    # ~10 ms steps; the elastic run is held at step 300 while its joiner starts (elastic_helpers.run)
    # and the preempted one at 250 until its agent asks it to stop: both land long before the end.
    # Four logical ranks: at 2 processes DDP would add (g0 + g1) + (g2 + g3), at one ((g0 + g1) + g2) + g3,
    # which differ in the last bits (two terms add alike in any order, so L = 2 would not show it).
    # With reduction="fast" this test fails at the first step after the first resize.
    common = dict(**workload(digits_npz, width=32), reduction="exact", logical_ranks=4, steps=500, batch_size=128,
                  checkpoint_every=100, eval_every=500)
    fixed = trial_config(tmp_path / "fixed", digits_npz, **common)
    finish(run_elastic(fixed, 2), fixed)
    elastic = trial_config(tmp_path / "elastic", digits_npz, **common, hold_at_step=300)
    finish(run_elastic(elastic, 2, [(100, 1), (300, 2)]), elastic)
    assert len(resizes(elastic)) == 2
    preempted = trial_config(tmp_path / "preempted", digits_npz, **common, hold_at_step=250)
    hold(preempted)
    proc = start(preempted, 2)
    wait_for_step(preempted, 250, proc)
    before = stop_requests(preempted)
    write_command(Path(preempted.trial_dir) / "control", 1, [])
    release_when_asked_to_stop(preempted, proc, before)
    assert proc.wait(timeout=60) == PREEMPTED
    finish(start(preempted, 1), preempted)

    want, want_weights = trace(fixed), final_weights(fixed)
    for other in (elastic, preempted):
        got = trace(other)
        assert sorted(got) == list(range(fixed.steps))
        assert all(got[s] == want[s] for s in want), next(s for s in want if got[s] != want[s])  # samples and loss, exactly
        weights = final_weights(other)
        assert any("running_var" in k for k in weights)
        for name in want_weights:
            assert torch.equal(want_weights[name], weights[name]), name


@pytest.mark.slow
def test_a_compiled_model_trains_and_checkpoints(tmp_path, user_root, digits_npz):
    """compile: true runs the step through torch.compile (inductor); weights load into the plain model."""
    cfg = replace(config(tmp_path / "compiled", digits_npz), compile=True, steps=10, checkpoint_every=5, eval_every=10)
    got = run(cfg, 1, user_root)
    assert json.loads(Path(cfg.result_path).read_text())["steps"] == 10
    assert not any(k.startswith("_orig_mod") for k in got)  # the checkpoint holds the model's own names
