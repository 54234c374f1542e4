"""A relaunch with nothing to train answers from the campaign's records: no Prefect, no
torch, no MLflow imported (a fraction of a second where a launch takes seconds), and only
when the records say so for every trial; `--timings` says each phase as it is reached."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_signed_results import trainer_result
from training.result import write_result

IMPORTS = ("torch", "prefect", "mlflow")


def finished_campaign(folder: Path, state: str = "ended", finished: int | None = None) -> Path:
    """A grid campaign's spec and the records its launch leaves once every trial has finished
    (its results signed as the trainer signs them), `finished` of them only when given."""
    from tasks.grid import expand_grid
    from tasks.records import CampaignRecord, TrialEntry, update_record, write_campaign
    from training.spec import load_spec

    params = folder / "params.yaml"
    params.write_text(yaml.safe_dump({
        "campaign": {"name": "done"}, "data": {"path": "data/digits.npz"}, "model": {"name": "small_cnn", "width": 8},
        "training": {"steps": 20, "batch_size": 16, "lr": 0.1}, "grid": {"training.lr": [0.1, 0.2]},
        "resources": {"devices": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"),
                     "summary": str(folder / "metrics" / "done.json")}}))
    spec = load_spec(params)
    trials = expand_grid(spec)
    write_campaign(spec.tracking.runs_dir, CampaignRecord(
        name="done", state=state, trials=tuple(TrialEntry(t.id, t.label, 20, dict(t.overrides)) for t in trials)))
    for i, trial in enumerate(trials[:finished]):
        trial_dir = spec.tracking.runs_dir / "done" / trial.id
        trial_dir.mkdir(parents=True)
        update_record(trial_dir, state="finished", devices=["cpu0"])
        write_result(trial_dir / "result.json", trainer_result(trial.id, metrics={"val_accuracy": 0.5 + i / 10}))
    (folder / "mlflow.db").write_bytes(b"")  # the store is there (its content is the launch's own check)
    (folder / "metrics").mkdir()
    (folder / "metrics" / "done.json").write_text(json.dumps({"campaign": "done", "written_by": "campaign", "trials": 2,
                                                               "finished": 2, "pruned": 0, "failed": 0}))
    return params


def launch_in_process(params: Path, *args: str) -> subprocess.CompletedProcess:
    """`campaign launch` in a process that says at its end which heavy packages it imported."""
    code = ("import sys; from flows.cli import app\n"
            "try:\n    app([" + ", ".join(repr(a) for a in ("launch", str(params), "--no-live", *args)) + "])\n"
            "except SystemExit as e:\n    code = e.code\n"
            f"print('imported:', [m for m in {IMPORTS!r} if m in sys.modules])\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=params.parent, timeout=120)


def test_a_relaunch_with_nothing_to_train_reads_the_records_and_imports_nothing_heavy(tmp_path):
    params = finished_campaign(tmp_path)
    done = launch_in_process(params, "--timings")
    assert "every one of its 2 trials has ended before: nothing to train" in done.stdout, done.stdout + done.stderr
    assert "finished 2/2 trials" in done.stdout and "val_accuracy 0.6000" in done.stdout  # the best of the two
    assert "trials' records read: nothing to do" in done.stdout  # --timings
    assert "imported: []" in done.stdout, done.stdout


@pytest.mark.parametrize("case", ["a trial not finished", "its last run did not end", "the store is gone", "a result forged",
                                  "the store is not one"])
def test_a_relaunch_with_anything_left_or_unsure_goes_the_whole_way(tmp_path, case):
    from flows.cli import _nothing_to_do
    from training.spec import load_spec

    params = finished_campaign(tmp_path, state="interrupted" if case == "its last run did not end" else "ended",
                               finished=1 if case == "a trial not finished" else None)
    if case == "the store is gone":
        (tmp_path / "mlflow.db").unlink()
    if case == "the store is not one":
        (tmp_path / "mlflow.db").write_bytes(b"SQLite format 3\x00" + b"\x00" * 50)  # truncated
    if case == "a result forged":
        result = next((tmp_path / "runs" / "done").glob("*/result.json"))
        forged = json.loads(result.read_text())
        result.write_text(json.dumps({**forged, "metrics": {"val_accuracy": 1.0}}))
    spec = load_spec(params)
    assert _nothing_to_do(spec, params) is None
    (tmp_path / "b").mkdir()
    untouched = finished_campaign(tmp_path / "b")
    assert _nothing_to_do(load_spec(untouched), untouched) is not None  # the same records, untouched


def test_phases_are_said_as_they_are_reached_with_their_time_since_the_process_started():
    from tasks.timings import Phases, process_started_at
    import time

    said: list[str] = []
    started = process_started_at()
    assert started <= time.time() and time.time() - started < 3600  # this process's own start
    phases = Phases(said.append, started_at=100.0)
    phases.mark("spec read", at=100.5)
    phases.mark("checked", at=101.75)
    assert said == ["  0.50 s  (+0.50 s)  spec read", "  1.75 s  (+1.25 s)  checked"]
    assert phases.since_start("checked") == 1.75


def test_the_first_step_is_this_launchs_not_the_last_steps_of_a_launch_just_killed(tmp_path, monkeypatch):
    """A `resume` begun as a killed launch's worker writes its last steps: those are not the
    resume's first step (its trials start from their checkpoint, once submitted)."""
    from tasks import timings
    from training.progress import progress_now

    said: list[str] = []
    phases = timings.Phases(said.append, started_at=time.time() - 1)
    monkeypatch.setattr(timings, "_current", phases)
    watch = timings.FirstStepWatch(phases, {tmp_path: 200})  # its checkpoint's step
    stale = dataclasses.replace(progress_now("running", 250, 300, 1, 128, {}), updated=time.time() - 0.5)
    stale.write(tmp_path)  # the killed launch's worker, after this one began
    assert not watch.check()
    timings.mark_first("submitted", "the first trial submitted (t)")
    assert not watch.check()  # written before: not this launch's
    progress_now("running", 201, 300, 1, 128, {}).write(tmp_path)
    assert watch.check() and said[-1].endswith("first training step (trial " + tmp_path.name + ", step 201)")


def test_the_workload_checks_cache_is_kept_across_edits_a_check_never_runs(tmp_path, monkeypatch):
    """The checks' cache key covers the code a check runs (the trainer's packages, the working
    folder's modules, the examples' workloads), not the project's tests or benches: an edit of a
    test must not cost the next launch its cached checks."""
    from tasks.workload import _python_files

    repo = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(repo)
    here = {p.relative_to(repo).parts[0] for p in _python_files()}
    assert {"training", "examples"} <= here and not here & {"tests", "bench", "flows", "cluster", "tasks"}
    assert len(_python_files()) == len(set(_python_files()))  # each file once
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "nets.py").write_text("X = 1\n")
    monkeypatch.chdir(tmp_path)
    assert tmp_path / "mylab" / "nets.py" in _python_files()  # the user's own modules count


def test_what_campaigns_wrote_does_not_cost_a_folder_its_cached_checks(tmp_path, monkeypatch):
    """A folder that ran many campaigns holds their trials' files (checkpoints, logs) and
    MLflow's artifacts by the ten thousand: not code. The walk leaves them out, so it stays
    under its limit and the checks stay remembered."""
    import os

    from tasks import workload

    trainer = Path(workload.__file__).resolve().parent.parent / "training"  # walked too
    walked = sum(len(names) + len([d for d in dirs if d != "__pycache__"]) for folder, dirs, names in os.walk(trainer)
                 if "__pycache__" not in folder)
    monkeypatch.setattr(workload, "MAX_FINGERPRINT_ENTRIES", walked + 40)
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "nets.py").write_text("X = 1\n")
    monkeypatch.chdir(tmp_path)
    first = workload.code_fingerprint()
    for i in range(30):  # a campaign's folder (its record marks it) and MLflow's artifact folder
        trial = tmp_path / "runs" / "c" / f"trial-{i}"
        trial.mkdir(parents=True)
        (trial / "train.log").write_text("")
        (tmp_path / "mlruns" / "1" / f"run-{i}").mkdir(parents=True)
        (tmp_path / "mlruns" / "1" / f"run-{i}" / "meta.yaml").write_text("")
    (tmp_path / "runs" / "c" / "campaign.json").write_text("{}")
    assert workload.code_fingerprint() == first  # the same key: its checks are found
    (tmp_path / "mylab" / "more.py").write_text("Y = 2\n")
    assert workload.code_fingerprint() != first  # code still counts
    for i in range(60):  # past the limit in folders that may hold code: never a stale key
        (tmp_path / "data" / f"part-{i}").mkdir(parents=True)
    assert len({workload.code_fingerprint() for _ in range(2)}) == 2


def test_a_function_trial_that_passed_its_check_is_not_checked_again_until_its_code_changes(tmp_path, monkeypatch):
    """A relaunch of a `training.target` campaign imports neither the user's module nor torch to
    check it again; an edit of the user's code checks it again, and a failure is never remembered."""
    import training.function
    from tasks.grid import expand_grid
    from tasks.workload import CHECK_CACHE_ENV, check_trials
    from training.errors import CampaignError
    from training.spec import parse_spec

    monkeypatch.setenv(CHECK_CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "loop.py").write_text("def fit(ctx, every=1):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    checked = []
    real = training.function.check_function
    monkeypatch.setattr(training.function, "check_function", lambda *a: checked.append(a[0]["target"]) or real(*a))

    def spec(target: str = "mylab.loop:fit", **grid):
        return parse_spec({"campaign": {"name": "c"}, "training": {"target": target, "steps": 2, "batch_size": 8, "lr": 0.1,
                                                                   "kwargs": {"every": 1}}, "grid": grid})

    check_trials(expand_grid(spec()))
    check_trials(expand_grid(spec()))
    assert checked == ["mylab.loop:fit"]  # the relaunch found it passed
    # Without a check hook only the keywords' names are checked: new values (a grid over them, a
    # new point) are not checked again; a keyword the function does not take is.
    check_trials(expand_grid(spec(**{"training.kwargs.every": [2, 3, 4]})))
    assert checked == ["mylab.loop:fit"]
    with pytest.raises(CampaignError, match="training.kwargs"):
        check_trials(expand_grid(spec(**{"training.kwargs.often": [2]})))
    assert len(checked) == 2
    checked.pop()
    (tmp_path / "mylab" / "loop.py").write_text("def fit(ctx, every=2):\n    pass\n")
    check_trials(expand_grid(spec()))
    assert len(checked) == 2  # the user's code changed: checked again
    for _ in range(2):
        with pytest.raises(CampaignError, match="training.target"):
            check_trials(expand_grid(spec("mylab.loop:missing")))
    assert len(checked) == 4  # a failure is checked every time
