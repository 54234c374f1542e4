"""Bring your own training loop: `training.target` runs a researcher's function under the
campaign (training/function.py), with our checkpoints, metrics, pruning and resizes.

Fast tests: the spec's rules, the pre-flight checks, a save and load in one process. Slow
ones: real campaigns (torchrun or elastic agents, MLflow, Optuna) of a user's function in a
package of its own."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import re
import textwrap
import threading
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from conftest import campaign_cli, wait_for
from training.config import TrialConfig
from training.files import read_json
from training.function import FunctionError, TrialContext, check_function
from training.layout import CampaignFiles, trial_files
from training.pruning import storage
from training.spec import SpecError, parse_spec

USER_LOOP = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def fit(ctx, width=16, lr=0.05, every=10, save_every=None, quality=1.0, fail_at=None):
    """A regression MLP on fixed synthetic data: the shape of a researcher's own loop."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    step = 0
    if (saved := ctx.load()) is not None:
        step, state = saved
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    net = DDP(model) if ctx.world_size > 1 else model
    while step < ctx.steps:
        i = (step * 32) % 512
        loss = F.mse_loss(net(x[i:i + 32][ctx.rank::ctx.world_size]), y[i:i + 32][ctx.rank::ctx.world_size])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if fail_at is not None and step == fail_at:
            raise ValueError(f"the user's own bug at step {step}")
        if step % every == 0:
            with torch.no_grad():
                ctx.report(step, train_loss=loss, val_loss=F.mse_loss(model(x), y).item() * quality)
        stop = ctx.should_stop()
        if step % (save_every or every) == 0 or stop:
            ctx.save(step, {"model": model, "opt": opt})
        if stop:
            return
    return {"final_width": width}


def fit_stateless(ctx, every=10, save_every=20, adam_from=80):
    """SGD without momentum (no optimizer state, ever), an Adam that steps only from step
    `adam_from` (no state before it) and a StepLR schedule: each save before adam_from holds
    two empty optimizer states."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.05)
    adam = torch.optim.Adam(model[2].parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(sgd, step_size=30, gamma=0.5)
    step = 0
    if (saved := ctx.load()) is not None:
        step, state = saved
        model.load_state_dict(state["model"])
        sgd.load_state_dict(state["sgd"])
        adam.load_state_dict(state["adam"])
        schedule.load_state_dict(state["schedule"])
    while step < ctx.steps:
        i = (step * 32) % 512
        loss = F.mse_loss(model(x[i:i + 32]), y[i:i + 32])
        sgd.zero_grad()
        adam.zero_grad()
        loss.backward()
        sgd.step()
        if step >= adam_from:
            adam.step()
        schedule.step()
        step += 1
        if step % every == 0:
            with torch.no_grad():
                ctx.report(step, train_loss=loss, val_loss=F.mse_loss(model(x), y).item(), lr=schedule.get_last_lr()[0])
        stop = ctx.should_stop()
        if step % save_every == 0 or stop:
            ctx.save(step, {"model": model, "sgd": sgd, "adam": adam, "schedule": schedule})
        if stop:
            return
    with torch.no_grad():
        return {"final_val_loss": F.mse_loss(model(x), y).item()}


def check(ctx, **kwargs):
    fit(ctx, **kwargs)


def never_reports(ctx, **kwargs):
    ctx.save(1, {"x": torch.ones(2)})


def broken_check(ctx, **kwargs):
    raise RuntimeError("the dry run found a bug")


def no_context():
    pass
'''


def write_user_package(root: Path) -> None:
    (root / "mylab").mkdir(parents=True, exist_ok=True)
    (root / "mylab" / "__init__.py").write_text("")
    (root / "mylab" / "loop.py").write_text(textwrap.dedent(USER_LOOP))


def spec_dict(tmp_path: Path, name: str, training: dict, **sections) -> dict:
    return {
        "campaign": {"name": name},
        "training": {"target": "mylab.loop:fit", "steps": 100, "batch_size": 32, "lr": 0.05, **training},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(tmp_path / "runs"), "summary": str(tmp_path / "s.json")},
        **sections,
    }


def write_params(tmp_path: Path, name: str, training: dict, **sections) -> Path:
    write_user_package(tmp_path)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(spec_dict(tmp_path, name, training, **sections)))
    return path


# --- the spec ---------------------------------------------------------------------------------

def test_a_function_trial_needs_no_model_and_varies_its_kwargs(tmp_path):
    from tasks.grid import expand_grid

    spec = parse_spec(spec_dict(tmp_path, "f", {"kwargs": {"width": 8}}, grid={"training.kwargs.width": [8, 16]}))
    assert spec.function and spec.model is None
    trials = expand_grid(spec)
    assert [t.spec.training.kwargs["width"] for t in trials] == [8, 16] and trials[0].id != trials[1].id


@pytest.mark.parametrize("training, resources, culprit", [
    ({"precision": "bf16"}, {}, "training.precision sets the project's own loop"),
    ({"scaling": "goodput"}, {"devices": [1, 2]}, "training.scaling sets the project's own loop"),
    ({"target": None, "kwargs": {"width": 8}}, {}, "training.kwargs and training.check belong to training.target"),
    ({}, {"memory_gb": "auto"}, "resources.memory_gb: auto measures the project's loop"),
    ({}, {"devices": "auto"}, "resources.devices: auto measures the project's loop"),
])
def test_settings_only_our_loop_honours_are_refused_naming_the_field(tmp_path, training, resources, culprit):
    raw = spec_dict(tmp_path, "f", training)
    raw["resources"].update(resources)
    with pytest.raises(SpecError, match=culprit.replace(".", r"\.").replace("(", r"\(")):
        parse_spec(raw)


def test_a_metric_of_ones_own_is_for_function_trials_only(tmp_path):
    search = {"strategy": "random", "trials": 2, "metric": "reward", "mode": "max", "space": {"training.lr": {"log_uniform": [0.01, 0.1]}}}
    assert parse_spec(spec_dict(tmp_path, "f", {}, search=search)).objective == ("reward", "max")
    ours = spec_dict(tmp_path, "f", {"target": None}, search=search, model={"name": "mlp", "width": 4})
    with pytest.raises(SpecError, match="search.metric: the project's loop reports val_loss"):
        parse_spec(ours)
    missing = spec_dict(tmp_path, "f", {"target": None})
    with pytest.raises(SpecError, match="model is missing"):
        parse_spec(missing)


# --- the checks before anything runs ------------------------------------------------------------

def dry_config(tmp_path: Path, target: str = "mylab.loop:fit", **kwargs) -> TrialConfig:
    return TrialConfig(trial_id="t", seed=0, model={}, data={}, steps=3, batch_size=32, lr=0.1, trial_dir=str(tmp_path / "dry"),
                       function={"target": target, "kwargs": kwargs}, async_checkpoints=False)


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    write_user_package(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m == "mylab" or m.startswith("mylab.")]:
        del sys.modules[name]


@pytest.mark.parametrize("target, check, culprit", [
    ("mylab.nothere:fit", None, "training.target: cannot import 'mylab.nothere'"),
    ("mylab.loop:no_context", None, "training.target: mylab.loop:no_context must take the trial context"),
    ("mylab.loop:fit", "mylab.loop:never_reports", "training.check: mylab.loop:never_reports never called ctx.report"),
    ("mylab.loop:fit", "mylab.loop:broken_check", "training.check: mylab.loop:broken_check raised RuntimeError: the dry run found a bug"),
])
def test_a_bad_target_or_check_is_refused_naming_the_field(user_package, target, check, culprit):
    cfg = dry_config(user_package, target)
    with pytest.raises(FunctionError, match=culprit.replace(".", r"\.").replace("(", r"\(")):
        check_function(cfg.function, {"target": check, "kwargs": {}} if check else None, cfg)


def test_the_check_hook_trains_reports_and_saves_on_the_cpu(user_package):
    cfg = dry_config(user_package, every=1)
    check_function(cfg.function, {"target": "mylab.loop:check", "kwargs": {"every": 1}}, cfg)  # no error: it reported and saved


def test_a_bad_target_exits_2_before_anything_runs(user_package):
    path = write_params(user_package, "bad", {"target": "mylab.loop:no_context"})
    done = campaign_cli("launch", str(path), cwd=user_package)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "training.target: mylab.loop:no_context must take the trial context" in " ".join(done.stderr.split())
    assert not (user_package / "runs" / "bad").exists() or not any((user_package / "runs" / "bad").glob("*/train.log"))


def test_save_and_load_give_back_plain_state_dicts(user_package):
    """Modules and optimizers are saved as state dicts; load gives them back ready for
    load_state_dict (the optimizer's parameter indices as ints again), in a fresh context."""
    cfg = dry_config(user_package)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ctx = TrialContext(cfg, 0, 1, 0, torch.device("cpu"), async_saves=False, quiet=True)
    assert ctx.load() is None  # a fresh start
    ctx.save(7, {"model": model, "opt": opt, "epoch": 2})
    ctx.close()
    again = TrialContext(cfg, 0, 1, 0, torch.device("cpu"), async_saves=False, quiet=True)
    step, state = again.load()
    again.close()
    assert step == 7 and state["epoch"] == 2
    twin = torch.nn.Linear(3, 2)
    twin.load_state_dict(state["model"])
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    twin_opt.load_state_dict(state["opt"])
    assert torch.equal(twin.weight, model.weight)
    assert torch.equal(twin_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_progress_says_the_measured_step_time_whatever_the_function_reports_under_that_name(user_package):
    """The watchdog's `auto` limit and the scheduler's speed are made of progress.json's step
    time: a function's own `step_time_s` (in milliseconds, say) stays its metric and does not
    replace the time measured between its reports."""
    from training.progress import read_progress

    cfg = dry_config(user_package)
    ctx = TrialContext(cfg, 0, 1, 0, torch.device("cpu"), async_saves=False, quiet=True)
    try:
        ctx.report(0, loss=1.0)
        ctx.report(5, loss=0.5, val_loss=0.4, step_time_s=250_000.0)  # a validation metric: written at once
    finally:
        ctx.close()
    progress = read_progress(Path(cfg.trial_dir))
    assert progress.step == 5 and 0 < progress.metrics["step_time_s"] < 60
    assert ctx.latest["step_time_s"] == 250_000.0


def test_empty_optimizer_and_scheduler_states_come_back_whole(user_package):
    """DCP keeps leaves only: an optimizer's `state` with nothing in it (plain SGD's, always;
    Adam's before its first step) came back without the key, and load_state_dict raised
    KeyError: 'state'. A save keeps the state's shape apart from its leaves, so every empty
    container comes back, int keys stay ints, and a list keeps its length."""
    cfg = dry_config(user_package)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.1)  # no momentum: no state, ever
    adam = torch.optim.Adam(model[1].parameters(), lr=0.01)  # never stepped: no state yet
    schedule = torch.optim.lr_scheduler.StepLR(sgd, step_size=2, gamma=0.5)
    for _ in range(3):
        sgd.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        sgd.step()
        schedule.step()
    extra = {"empty": {}, "history": [{}, {"a": 1}, []], "ids": {3: "int", "3": "text"}, "pair": (1, 2)}
    ctx = TrialContext(cfg, 0, 1, 0, torch.device("cpu"), async_saves=False, quiet=True)
    ctx.save(3, {"model": model, "sgd": sgd, "adam": adam, "schedule": schedule, "extra": extra})
    ctx.close()
    again = TrialContext(cfg, 0, 1, 0, torch.device("cpu"), async_saves=False, quiet=True)
    step, state = again.load()
    again.close()
    assert step == 3
    assert state["sgd"] == sgd.state_dict() and state["sgd"]["state"] == {}
    assert state["adam"] == adam.state_dict() and state["adam"]["state"] == {}
    assert state["schedule"] == schedule.state_dict() and state["extra"] == extra

    twin = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    twin.load_state_dict(state["model"])
    twin_sgd = torch.optim.SGD(twin[0].parameters(), lr=0.1)
    twin_adam = torch.optim.Adam(twin[1].parameters(), lr=0.01)
    twin_schedule = torch.optim.lr_scheduler.StepLR(twin_sgd, step_size=2, gamma=0.5)
    twin_sgd.load_state_dict(state["sgd"])  # KeyError: 'state' before
    twin_adam.load_state_dict(state["adam"])
    twin_schedule.load_state_dict(state["schedule"])
    assert twin_sgd.param_groups[0]["lr"] == sgd.param_groups[0]["lr"] == 0.05
    x = torch.randn(4, 3)
    for net, opts in ((model, (sgd, adam)), (twin, (twin_sgd, twin_adam))):  # the same next step on both
        net.zero_grad()
        net(x).sum().backward()
        for opt in opts:
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_a_checkpoint_saved_before_saves_kept_their_shape_still_loads(user_package):
    """A trial saved by the earlier layout (DCP's own nesting under "app") resumes after an
    upgrade: its optimizer's parameter indices come back as ints, as they did."""
    cfg = dry_config(user_package)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ctx = TrialContext(cfg, 0, 1, 0, torch.device("cpu"), async_saves=False, quiet=True)
    ctx.checkpointer.save(4, {"app": {"model": model.state_dict(), "opt": opt.state_dict()}, "progress": {"step": 4}})
    step, state = ctx.load()
    ctx.close()
    assert step == 4 and list(state["opt"]["state"]) == [0, 1]
    torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.01).load_state_dict(state["opt"])


# --- real campaigns -----------------------------------------------------------------------------

def trial_runs(tmp_path: Path, experiment: str = "campaigns"):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id], "tags.`campaign.kind` = 'trial'")
    return client, runs


@pytest.mark.slow
def test_function_trials_report_to_mlflow_and_the_study_and_a_raising_one_fails_alone(tmp_path):
    """A grid search over the function's kwargs: the good trial's metrics are in MLflow and
    the study; the one whose function raises fails with the user's traceback in its log and
    in `campaign logs`, and the campaign finishes the other."""
    import optuna

    search = {"strategy": "grid", "space": {"training.kwargs.fail_at": {"choice": [None, 25]}}}
    write_params(tmp_path, "fn", {"kwargs": {"every": 10}}, search=search)
    done = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # one trial failed
    root = tmp_path / "runs" / "fn"
    finished = [p.parent for p in root.glob("*/result.json")]
    assert len(finished) == 1
    result = json.loads((finished[0] / "result.json").read_text())
    assert result["steps"] == 100 and result["metrics"]["final_width"] == 16 and Path(result["checkpoint"]).name == "step-00000100"
    failed = next(p for p in root.iterdir() if p.is_dir() and p != finished[0] and (p / "train.log").exists())
    log = (failed / "train.log").read_text()
    assert "Traceback" in log and "ValueError: the user's own bug at step 25" in log
    logs = campaign_cli("logs", failed.name, "--runs-dir", str(tmp_path / "runs"))
    assert "ValueError: the user's own bug at step 25" in logs.stdout
    # The launch kept the objective its trials rank by; `campaign status` names the best by it.
    assert json.loads((root / "campaign.json").read_text())["objective"] == ["val_loss", "min"]
    status = campaign_cli("status", "--runs-dir", str(tmp_path / "runs"))
    assert f"★ best: {finished[0].name}, val_loss" in status.stdout, status.stdout
    # `campaign export` gives back what the function saved at its end, by the names it used.
    exported = campaign_cli("export", "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "best.pt"))
    assert exported.returncode == 0 and 'torch.load("' in exported.stdout, exported.stdout + exported.stderr
    saved = torch.load(tmp_path / "best.pt", weights_only=True)
    assert saved["trial_id"] == finished[0].name and saved["step"] == 100 and "model" not in saved
    assert set(saved["state"]) == {"model", "opt"} and all(isinstance(v, torch.Tensor) for v in saved["state"]["model"].values())

    client, runs = trial_runs(tmp_path)
    (good,) = [r for r in runs if r.data.tags.get("campaign.state") == "finished"]
    history = client.get_metric_history(good.info.run_id, "val_loss")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(10, 101, 10))
    study = optuna.load_study(study_name="fn", storage=storage(str(CampaignFiles(root).study)))
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert len(complete) == 1 and complete[0].value == pytest.approx(result["metrics"]["val_loss"])


@pytest.mark.slow
def test_a_search_fills_every_free_device_before_it_stages_a_trial(tmp_path):
    """A search draws one trial at a time: on two free slots its second draw starts on the
    second slot in the loop's first round, before a third is drawn to wait (staged) behind
    them, not a round of the loop later."""
    search = {"strategy": "grid", "space": {"training.kwargs.quality": {"choice": [1.0, 2.0, 3.0]}}}
    write_params(tmp_path, "fill", {"kwargs": {"every": 10}}, search=search)
    done = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stderr.splitlines()  # the flow's log
    drawn = {int(m.group(1)): m.group(2) for line in lines if (m := re.search(r"search: trial (\d)/3 is (\S+)", line))}
    second_starts = next(i for i, line in enumerate(lines) if f"trial {drawn[2]} " in line and " starts on " in line)
    third_drawn = next(i for i, line in enumerate(lines) if "search: trial 3/3 is" in line)
    assert second_starts < third_drawn, "\n".join(lines)
    assert "(in the warm worker of" not in lines[second_starts]  # its own device, not after the first


def launch_held_at_65(tmp_path: Path, root: Path) -> tuple[subprocess.Popen, Path]:
    """`campaign launch` of tmp_path's params.yaml, its one trial (under `root`) held at step
    65; the campaign process and the trial's folder, once it holds there."""
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "CAMPAIGN_HOLD_AT_STEP": "65"})
    trial_dir = wait_for(lambda: next((p for p in root.iterdir() if p.is_dir()), None) if root.is_dir() else None, 300, "the trial's folder")
    trial_files(trial_dir).hold.touch()
    wait_for(lambda: (read_json(trial_dir / "progress.json") or {}).get("state") == "held" or proc.poll() is not None, 300, "the hold")
    assert proc.poll() is None
    return proc, trial_dir


@pytest.mark.slow
def test_a_killed_function_trial_resumes_from_its_last_save_without_reporting_a_step_twice(tmp_path):
    """SIGKILL to the campaign while the trial is held after reporting step 70 (saved every 20
    steps); launching again resumes from the last save, replays step 70, and MLflow holds each
    step once."""
    write_params(tmp_path, "kill", {"kwargs": {"every": 10, "save_every": 20}, "steps": 120},
                 resources={"devices": 2}, cluster={"cpu_slots": 2})
    proc, trial_dir = launch_held_at_65(tmp_path, tmp_path / "runs" / "kill")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_for(lambda: not any(str(trial_dir).encode() in p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if _readable(p)),
             30, "the trial's processes to end")
    saved = sorted(p.name for p in (trial_dir / "checkpoints").glob("step-*"))  # nothing writes them now
    assert saved and saved[-1] in ("step-00000040", "step-00000060")  # saved every 20; step 70 reported, not saved
    trial_files(trial_dir).hold.unlink()
    done = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((trial_dir / "result.json").read_text())
    assert result["steps"] == 120 and f"step-{result['resumed_from_step']:08d}" == saved[-1]
    assert "resumed at step" in (trial_dir / "train.log").read_text()
    client, (run,) = trial_runs(tmp_path)
    assert Path(run.data.tags[f"resume.step-{result['resumed_from_step']}"]).name == saved[-1]  # which checkpoint it used
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")]
    assert sorted(steps) == list(range(10, 121, 10))  # each once, the replayed ones too


@pytest.mark.slow
def test_a_killed_function_trial_with_empty_optimizer_states_resumes_to_an_uninterrupted_runs_result(user_package):
    """Plain SGD, an Adam not stepped yet and an LR schedule, saved every 20 steps; the
    campaign and the trial's processes SIGKILLed while it is held at step 70. The next launch
    resumes from the last save (load_state_dict raised KeyError: 'state' there before) and
    ends where one uninterrupted run of the same function, in this process, ends."""
    write_params(user_package, "stateless", {"target": "mylab.loop:fit_stateless", "kwargs": {"every": 10, "save_every": 20},
                                             "steps": 120})
    proc, trial_dir = launch_held_at_65(user_package, user_package / "runs" / "stateless")
    trial_processes = psutil.Process(proc.pid).children(recursive=True)
    assert trial_processes
    os.kill(proc.pid, signal.SIGKILL)
    for process in trial_processes:  # the trial's own processes too, not left to their parent-death signal
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(trial_processes, timeout=30)
    saved = sorted(p.name for p in (trial_dir / "checkpoints").glob("step-*"))[-1]  # nothing writes them now
    assert saved in ("step-00000040", "step-00000060")  # saved every 20 (the last in the background); 70 reported, not saved
    trial_files(trial_dir).hold.unlink()
    done = campaign_cli("launch", "params.yaml", cwd=user_package)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((trial_dir / "result.json").read_text())
    assert result["steps"] == 120 and f"step-{result['resumed_from_step']:08d}" == saved, result
    assert "KeyError" not in (trial_dir / "train.log").read_text()

    from mylab.loop import fit_stateless

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the trial's process computes
    try:
        cfg = dataclasses.replace(dry_config(user_package, "mylab.loop:fit_stateless"), steps=120)
        ctx = TrialContext(cfg, 0, 1, 0, torch.device("cpu"), async_saves=False, quiet=True)
        uninterrupted = fit_stateless(ctx, every=10, save_every=20)
        ctx.close()
    finally:
        torch.set_num_threads(threads)
    assert result["metrics"]["lr"] == ctx.latest["lr"] == 0.05 * 0.5 ** 4
    assert result["metrics"]["final_val_loss"] == pytest.approx(uninterrupted["final_val_loss"], rel=1e-6)
    assert result["metrics"]["val_loss"] == pytest.approx(ctx.latest["val_loss"], rel=1e-6)


def _readable(path: Path) -> bool:
    try:
        path.read_bytes()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_the_pruner_stops_a_function_trial_and_its_slot_goes_to_the_next(tmp_path):
    """One slot, the median rule: the trial whose reported loss is ten times worse stops at
    its first evaluation from min_steps on, recorded pruned, and the next trial runs."""
    write_params(tmp_path, "prune", {"kwargs": {"every": 20}, "steps": 200},
                 grid={"training.kwargs.quality": [1.0, 10.0, 0.5]}, early_stopping={"rule": "median", "min_steps": 40},
                 cluster={"cpu_slots": 1})
    done = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    root = tmp_path / "runs" / "prune"
    results = {p.parent.name: json.loads(p.read_text()) for p in root.glob("*/result.json")}
    (worse,) = [t for t in results if t.startswith("quality10")]
    assert results[worse]["pruned"] and results[worse]["steps"] == 40
    # Its save after the stop wrote nothing (a pruned trial is final): the result points at the last one.
    assert Path(results[worse]["checkpoint"]).name == "step-00000020"
    assert sorted(p.name for p in (root / worse / "checkpoints").glob("step-*")) == ["step-00000020"]
    assert sum(not r["pruned"] for r in results.values()) == 2 and all(r["steps"] == 200 for r in results.values() if not r["pruned"])
    _, runs = trial_runs(tmp_path)
    assert sorted(r.data.tags["campaign.state"] for r in runs) == ["finished", "finished", "pruned"]


@pytest.mark.slow
def test_a_hand_resize_restarts_a_function_trial_at_its_new_size_from_its_save(tmp_path):
    """An elastic [1, 2] function trial held at a step; `campaign resize` to 1: the function
    is told to stop (should_stop), saves, and a one-process generation loads that save."""
    write_params(tmp_path, "resize", {"kwargs": {"every": 10}, "steps": 300}, resources={"devices": [1, 2]},
                 cluster={"cpu_slots": 2})
    root = tmp_path / "runs" / "resize"
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "CAMPAIGN_HOLD_AT_STEP": "100"})
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    trial_dir = wait_for(lambda: next((p for p in root.iterdir() if p.is_dir()), None) if root.is_dir() else None, 300, "the trial's folder")
    trial_files(trial_dir).hold.touch()
    wait_for(lambda: (read_json(trial_dir / "progress.json") or {}).get("state") == "held" or proc.poll() is not None, 300, "the hold")
    assert (read_json(trial_dir / "progress.json") or {}).get("world_size") == 2, "".join(out)[-3000:]
    resize = subprocess.Popen([sys.executable, "-m", "flows.cli", "resize", trial_dir.name, "1", "--runs-dir", str(tmp_path / "runs"),
                               "--wait-s", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any((trial_dir / "control").glob("stop-*")) or resize.poll() is not None, 120, "the agent's stop request")
    trial_files(trial_dir).hold.unlink()  # the function goes on, is told to stop, saves and returns
    answer = resize.communicate(timeout=150)
    assert resize.returncode == 0, answer
    assert proc.wait(timeout=300) == 0, "".join(out)[-3000:]
    reader.join(timeout=10)
    (event,) = [json.loads(line) for line in (trial_dir / "resizes.jsonl").read_text().splitlines()]
    assert (len(event["from"]), len(event["to"]), event["mode"]) == (2, 1, "restart")
    result = json.loads((trial_dir / "result.json").read_text())
    assert result["world_size"] == 1 and result["steps"] == 300 and result["resumed_from_step"] >= 100
    assert f"resumed at step {result['resumed_from_step']}" in (trial_dir / "train.log").read_text()


def test_campaign_profile_says_it_does_not_own_a_function_trials_layers(user_package):
    path = write_params(user_package, "prof", {})
    done = campaign_cli("profile", str(path), cwd=user_package)
    assert done.returncode == 2
    assert "profiles the project's loop" in " ".join(done.stderr.split())


@pytest.mark.slow
def test_sigterm_makes_should_stop_true_and_the_function_saves_where_it_is(user_package):
    """A stopping campaign SIGTERMs its trials' process groups and waits before SIGKILL: a
    function trial is told by should_stop(), saves at the step it is at (not a save_every
    one), returns, and has no result (it is not finished)."""
    cfg = TrialConfig(trial_id="term", seed=0, model={}, data={}, steps=400, batch_size=32, lr=0.05,
                      trial_dir=str(user_package / "term"), hold_at_step=35,
                      function={"target": "mylab.loop:fit", "kwargs": {"every": 5, "save_every": 100}})
    Path(cfg.trial_dir).mkdir()
    trial_files(cfg.trial_dir).hold.touch()
    path = Path(cfg.trial_dir) / "trial.json"
    path.write_text(cfg.to_json())
    proc = subprocess.Popen([sys.executable, "-m", "training.launch", "--standalone", "--nproc-per-node=1", "-m", "training.train",
                             "--config", str(path)], cwd=user_package, stdout=open(Path(cfg.trial_dir) / "train.log", "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for(lambda: (read_json(Path(cfg.trial_dir) / "progress.json") or {}).get("state") == "held" or proc.poll() is not None, 120, "the hold")
    workers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGTERM)  # as stop_launched_trials does: the whole group
    # torchrun forwards the SIGTERM to its workers (their own sessions) in its own time; sent here
    # too, it is pending in the worker before the hold ends, so the worker cannot take a step first
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    trial_files(cfg.trial_dir).hold.unlink()
    proc.wait(timeout=60)
    saved = sorted(p.name for p in (Path(cfg.trial_dir) / "checkpoints").glob("step-*"))
    assert saved == ["step-00000035"], (Path(cfg.trial_dir) / "train.log").read_text()[-2000:]
    assert not (Path(cfg.trial_dir) / "result.json").exists()
    assert "stopped at step 35 (SIGTERM" in (Path(cfg.trial_dir) / "train.log").read_text()


@pytest.mark.slow
def test_a_stopping_campaign_lets_an_elastic_function_trial_save_where_it_is(user_package):
    """An elastic function trial on two processes, held after reporting step 40; SIGTERM to
    its process group (as a stopping campaign sends): the agent does not kill the workers but
    waits while the function, told by should_stop(), saves step 40 and returns; it exits as
    preempted, and the next start resumes from that save."""
    from tests.elastic_helpers import cpu_slot
    from training.elastic import PREEMPTED
    from training.agent_commands import write_command
    from training.layout import agent_state_in

    cfg = TrialConfig(trial_id="eterm", seed=0, model={}, data={}, steps=80, batch_size=32, lr=0.05,
                      trial_dir=str(user_package / "eterm"), hold_at_step=40, control_every=1,
                      function={"target": "mylab.loop:fit", "kwargs": {"every": 10, "save_every": 1000}})
    trial_dir, control = Path(cfg.trial_dir), Path(cfg.trial_dir) / "control"
    control.mkdir(parents=True)
    trial_files(trial_dir).hold.touch()
    (trial_dir / "trial.json").write_text(cfg.to_json())

    def start(devices: int) -> subprocess.Popen:
        for old in control.glob("command-*.json"):
            old.unlink()
        write_command(control, 0, [cpu_slot(i) for i in range(devices)])
        return subprocess.Popen([sys.executable, "-m", "training.elastic", "--config", str(trial_dir / "trial.json"), "--control", str(control)],
                                cwd=user_package, stdout=open(trial_dir / "agent.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)

    agent = start(2)
    wait_for(lambda: (read_json(cfg.progress_path) or {}).get("state") == "held" or agent.poll() is not None, 120, "the hold")
    assert agent.poll() is None, (trial_dir / "agent.log").read_text()[-3000:]
    os.killpg(agent.pid, signal.SIGTERM)  # the agent and its workers share the group: each has it before the hold ends
    trial_files(trial_dir).hold.unlink()
    assert agent.wait(timeout=60) == PREEMPTED, (trial_dir / "agent.log").read_text()[-3000:]
    assert sorted(p.name for p in (trial_dir / "checkpoints").glob("step-*")) == ["step-00000040"]
    assert read_json(agent_state_in(control))["status"] == "preempted"
    assert not (trial_dir / "result.json").exists()
    again = start(1)
    assert again.wait(timeout=120) == 0, (trial_dir / "agent.log").read_text()[-3000:]
    result = json.loads((trial_dir / "result.json").read_text())
    assert (result["steps"], result["resumed_from_step"], result["world_size"]) == (80, 40, 1)


@pytest.mark.parametrize("example", ["chargpt_loop", "gan"])
def test_the_function_examples_pass_their_preflight_check(example, monkeypatch):
    """Each own-loop example's target imports, takes the context, and its check hook runs a
    report and a save on two samples (what `campaign launch` runs before anything starts)."""
    from conftest import REPO
    from tasks.grid import expand_grid
    from tasks.workload import check_trials
    from training.spec import load_spec

    monkeypatch.chdir(REPO)  # targets are `examples.workloads...`, imported from the launch directory
    spec = load_spec(REPO / "examples" / f"{example}.yaml")
    assert spec.function and spec.training.check
    check_trials(expand_grid(spec))
