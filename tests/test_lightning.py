"""PyTorch Lightning as a function trial (training/lightning.py, examples/lightning/).

Fast tests: in this process, the example's LightningModule on a trial context of its own:
`self.log` reaches `ctx.report` once per step, a second fit resumes after the save, a stop or
a pruning ends the fit (a stop after a save at that step), the trial's own Trainer arguments are
refused, the example passes the campaign's pre-flight check, and the module says how to
install Lightning when it is missing. Slow ones: the example through `campaign launch`, and a
two-process (DDP) trial whose campaign is SIGKILLed mid-trial and launched again.

Lightning is imported here unguarded: without it these tests fail, they are not skipped
(`make test` installs the `lightning` extra)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning  # not installed: these tests fail here, loudly
import psutil
import pytest
import torch
import yaml

from conftest import REPO, campaign_cli, wait_for
from training.config import TrialConfig
from training.files import read_json
from training.function import FunctionError, TrialContext
from training.layout import trial_files

EXAMPLE = REPO / "examples" / "lightning" / "params.yaml"


@pytest.fixture
def digits(monkeypatch):
    """The example's module (imported from the repository, as a launch from its root does)."""
    monkeypatch.syspath_prepend(str(REPO))
    from examples.lightning import digits

    return digits


def context(folder: Path, steps: int) -> TrialContext:
    cfg = TrialConfig(trial_id="t", seed=0, model={}, data={}, steps=steps, batch_size=32, lr=0.003, trial_dir=str(folder),
                      function={"target": "examples.lightning.digits:train", "kwargs": {}}, async_checkpoints=False,
                      checkpoint_every=20, log_every=10, eval_every=25)
    return TrialContext(cfg, 0, 1, 0, torch.device("cpu"), async_saves=False, quiet=True)


def fit(digits, folder: Path, steps: int, on_report=None) -> tuple[TrialContext, list[tuple[int, set[str]]]]:
    """The example's `train` on one process; every report it made, as (step, metric names)."""
    ctx, reports = context(folder, steps), []
    report = ctx.report

    def recorded(step, **metrics):
        reports.append((step, set(metrics)))
        if on_report is not None:
            on_report(ctx, step)
        return report(step, **metrics)

    ctx.report = recorded
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a trial's process computes
    sigterm = signal.signal(signal.SIGTERM, lambda *_: setattr(ctx, "terminated", True))  # as FunctionTrial.train does
    try:
        torch.manual_seed(0)
        digits.train(ctx, hidden=16, batch_size=32)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        torch.set_num_threads(threads)
        ctx.close()
    return ctx, reports


def saved_steps(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoints").glob("step-*"))


# --- in this process --------------------------------------------------------------------------

def test_self_log_is_reported_once_per_step_and_a_second_fit_resumes_after_the_save(digits, tmp_path):
    """log_every 10, validation every 25, saves every 20: one report per step that logged,
    the step's training and validation values together; the next fit (more steps) loads
    Lightning's whole state from the last save and reports only the steps after it."""
    ctx, reports = fit(digits, tmp_path, 60)
    assert [step for step, _ in reports] == [10, 20, 25, 30, 40, 50, 60]
    named = dict(reports)
    assert named[25] == {"val_loss", "val_acc", "epoch"} and named[50] == {"train_loss", "val_loss", "val_acc", "epoch"}
    assert saved_steps(tmp_path) == ["step-00000040", "step-00000060"]  # every 20 and the last; two kept

    ctx, reports = fit(digits, tmp_path, 100)
    assert ctx.started_step == 60
    assert [step for step, _ in reports] == [70, 75, 80, 90, 100]  # the cadence goes on: Lightning's loops restored
    assert saved_steps(tmp_path) == ["step-00000080", "step-00000100"]


@pytest.mark.parametrize("flag", ["sigterm", "pruned"])
def test_should_stop_stops_the_trainer_after_a_save_at_that_step(digits, tmp_path, flag):
    """A SIGTERM (the trial's handler, not Lightning's, takes it: no exception ends the fit),
    or the pruner's verdict, while step 30 is reported: the next step's end asks should_stop,
    the trainer stops there, and (a stop, not a pruning: a pruned trial is final) that step is
    saved once its metrics (with Lightning's validation, which a stop brings) are reported."""
    def stop_at_30(ctx, step):
        if step == 30:
            os.kill(os.getpid(), signal.SIGTERM) if flag == "sigterm" else setattr(ctx, "pruned", True)

    ctx, reports = fit(digits, tmp_path, 200, on_report=stop_at_30)
    assert reports[-1] == (31, {"train_loss", "val_loss", "val_acc", "epoch"})  # Lightning logs a stopping step
    if flag == "sigterm":
        assert saved_steps(tmp_path)[-1] == "step-00000031"
    else:  # a pruned trial is final: nothing is taken or written at its stop, the last save stands
        assert saved_steps(tmp_path) and "step-00000031" not in saved_steps(tmp_path)
    assert (ctx.pruned, ctx.stopped) == ((True, False) if flag == "pruned" else (False, True))


def test_a_pruning_counts_for_the_collective_steps_only_once_every_rank_agreed_it(tmp_path):
    """Rank 0 learns of a pruning at its report, the others at the next agreement: the save
    and Lightning's checkpoint skip on `stopped_by_pruner`, which every rank reads alike."""
    ctx = context(tmp_path, 10)
    try:
        ctx.pruned = True  # rank 0's pruner said so at its report
        assert not ctx.stopped_by_pruner
        assert ctx.should_stop() and ctx.stopped_by_pruner
    finally:
        ctx.close()


def test_the_callback_on_a_trainer_of_its_own_says_to_build_it_with_campaign_trainer(digits, tmp_path):
    from training.lightning import CampaignCallback

    ctx = context(tmp_path, 10)
    trainer = lightning.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[CampaignCallback(ctx)])
    try:
        with pytest.raises(FunctionError, match=r"build the trainer with training\.lightning\.campaign_trainer\(ctx, \.\.\.\)"):
            trainer.fit(digits.DigitsClassifier(steps=2), digits.DigitsData(32))
    finally:
        ctx.close()


def test_trainer_arguments_the_trial_decides_are_refused_naming_the_field(digits, tmp_path):
    from training.lightning import campaign_trainer

    ctx = context(tmp_path, 10)
    try:
        with pytest.raises(FunctionError, match=r"Trainer\(devices=\.\.\.\) is the trial's: resources\.devices.*"
                                                r"Trainer\(max_steps=\.\.\.\) is the trial's: training\.steps"):
            campaign_trainer(ctx, devices=2, max_steps=5)
    finally:
        ctx.close()


def test_the_lightning_example_passes_its_preflight_check(monkeypatch):
    """Its target imports and takes the context; its check hook fits one step on two samples,
    reports and saves (what `campaign launch` runs before anything starts)."""
    from tasks.grid import expand_grid
    from tasks.workload import check_trials
    from training.spec import load_spec

    monkeypatch.chdir(REPO)  # targets are `examples.lightning...`, imported from the launch directory
    spec = load_spec(EXAMPLE)
    assert spec.function and spec.training.check
    check_trials(expand_grid(spec))


def test_without_lightning_the_module_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # what an environment without it imports
    monkeypatch.delitem(sys.modules, "training.lightning", raising=False)
    with pytest.raises(ImportError, match=r"pip install -c constraints\.txt -e '\.\[lightning\]'"):
        importlib.import_module("training.lightning")


# --- through `campaign launch` ---------------------------------------------------------------

def example_params(tmp_path: Path, name: str, steps: int = 60, devices: int = 1, grid: dict | None = None) -> Path:
    """The example's spec at a small size, its records under tmp_path (launched from there:
    the example's package comes from PYTHONPATH, the repository, as tests/conftest.py sets)."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["campaign"]["name"] = name
    spec["training"].update(steps=steps, checkpoint_every=20, log_every=10, eval_every=25)
    spec["early_stopping"]["min_steps"] = 25
    spec["resources"] = {"devices": devices}
    spec["cluster"] = {"cpu_slots": 2}
    spec["tracking"] = {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(tmp_path / "runs"),
                        "summary": str(tmp_path / "s.json")}
    if grid is not None:
        spec["grid"] = grid
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def trial_runs(tmp_path: Path):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("campaigns").experiment_id], "tags.`campaign.kind` = 'trial'")
    return client, runs


def metric_steps(client, run, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, key))


@pytest.mark.slow
def test_the_lightning_example_runs_through_campaign_launch(tmp_path):
    """The example's 2x2 grid at 60 steps: every trial ends (finished, or pruned by the median
    rule on the val_loss its module logs), each with its logged steps in MLflow once."""
    example_params(tmp_path, "lightning-small")
    done = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "lightning-small").glob("*/result.json")]
    assert len(results) == 4 and all(r["function"] == "examples.lightning.digits:train" for r in results)
    client, runs = trial_runs(tmp_path)
    assert len(runs) == 4
    for run in runs:
        if run.data.tags["campaign.state"] == "finished":
            assert metric_steps(client, run, "train_loss") == list(range(10, 61, 10))
            assert metric_steps(client, run, "val_loss") == [25, 50]
        else:
            assert run.data.tags["campaign.state"] == "pruned", run.data.tags


@pytest.mark.slow
def test_a_sigkilled_lightning_trial_resumes_from_its_last_save_and_mlflow_holds_each_step_once(tmp_path):
    """Two processes (one DDP model over the trial's process group), 120 steps, saved every 20;
    held after reporting step 70, the campaign's process group is SIGKILLed. The next launch
    resumes from the last save through Lightning's own restore, replays the steps after it,
    and MLflow holds every logged step of train_loss and val_loss exactly once."""
    example_params(tmp_path, "lightning-kill", steps=120, devices=2, grid={"training.kwargs.hidden": [32]})
    root = tmp_path / "runs" / "lightning-kill"
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"], cwd=tmp_path,
                            stdout=open(tmp_path / "out.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "CAMPAIGN_HOLD_AT_STEP": "65"})
    processes: list[psutil.Process] = []
    try:
        trial_dir = wait_for(lambda: next((p for p in root.iterdir() if p.is_dir()), None) if root.is_dir() else None, 300,
                             "the trial's folder")
        trial_files(trial_dir).hold.touch()
        wait_for(lambda: (read_json(trial_dir / "progress.json") or {}).get("state") == "held" or proc.poll() is not None, 300,
                 "the hold")
        assert proc.poll() is None, (tmp_path / "out.log").read_text()[-3000:]
        processes = psutil.Process(proc.pid).children(recursive=True)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the campaign, its hub, its Prefect server: all at once
        proc.wait()
    _, alive = psutil.wait_procs(processes, timeout=60)  # the trial's own: ended by their parents' death
    assert not alive, [p.pid for p in alive]
    saved = saved_steps(trial_dir)  # nothing writes them now
    assert saved and saved[-1] in ("step-00000040", "step-00000060")  # every 20; 70 reported, not saved
    assert (read_json(trial_dir / "progress.json") or {}).get("step") == 70

    trial_files(trial_dir).hold.unlink()
    done = campaign_cli("launch", "params.yaml", "--no-live", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((trial_dir / "result.json").read_text())
    assert (result["steps"], result["world_size"]) == (120, 2)
    assert f"step-{result['resumed_from_step']:08d}" == saved[-1]
    assert f"Restoring states from the checkpoint path at {trial_dir / 'checkpoints' / saved[-1]}" in (trial_dir / "train.log").read_text()
    client, (run,) = trial_runs(tmp_path)
    assert metric_steps(client, run, "train_loss") == list(range(10, 121, 10))  # each once, the replayed ones too
    assert metric_steps(client, run, "val_loss") == [25, 50, 75, 100]
    # The two processes split each epoch (Lightning's distributed sampler over the trial's group):
    # 1,437 samples, half each in batches of 32, make 22 steps an epoch, so step 25 is in the
    # second (each process on all of them would take 44 steps an epoch).
    assert [m.value for m in client.get_metric_history(run.info.run_id, "epoch") if m.step == 25] == [1.0]
