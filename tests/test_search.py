"""Search beyond the grid: Optuna samplers and pruners, a study that survives a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import campaign_cli
from training.spec import parse_spec
from tasks.search import Search
from training.layout import CampaignFiles, trial_files
from training.pruning import storage

BASE = {"campaign": {"name": "s"}, "model": {"name": "mlp", "width": 16},
        "training": {"steps": 100, "batch_size": 16, "lr": 0.1, "eval_every": 20}}


def spec(**sections):
    return parse_spec({**BASE, **sections})


# --- the study, alone ---------------------------------------------------------------------

def test_a_new_study_file_never_inherits_what_this_process_replayed_of_a_deleted_one(tmp_path):
    import optuna

    from training.pruning import storage

    journal = str(tmp_path / "search.journal")
    study = optuna.create_study(storage=storage(journal), study_name="s")
    study.tell(study.ask(), 1.0)
    assert storage(journal) is storage(journal)  # one per process and file
    os.unlink(journal)  # deleted by hand: the same path, a new file
    fresh = optuna.create_study(storage=storage(journal), study_name="s")
    assert len(fresh.trials) == 0
    assert len(optuna.load_study(study_name="s", storage=storage(journal)).trials) == 0


HOLD_AND_WAIT = """
import sys, time
sys.path.insert(0, sys.argv[2])
from training.pruning import _FileLock
lock = _FileLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.read()  # killed here, the lock held
"""


def test_a_writer_killed_while_it_holds_the_studys_lock_does_not_hold_up_the_next(tmp_path):
    """Optuna's own file locks, left behind by a kill, kept every later writer waiting for
    their grace period (30 s); the study's flock is let go of by the kernel."""
    import threading

    import optuna

    from training.pruning import storage

    journal = str(tmp_path / "search.journal")
    study = optuna.create_study(storage=storage(journal), study_name="s")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_WAIT, journal, str(Path(__file__).resolve().parents[1])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    told = threading.Event()
    writer = threading.Thread(target=lambda: (study.tell(study.ask(), 2.0), told.set()), daemon=True)
    writer.start()
    assert not told.wait(timeout=0.5)  # waits while the holder lives
    holder.kill()
    holder.wait()
    assert told.wait(timeout=20)  # not the 30 s of a stale lock file
    assert [t.value for t in optuna.load_study(study_name="s", storage=storage(journal)).trials] == [2.0]


def test_a_journal_whose_last_entry_was_cut_off_loses_that_entry_alone(tmp_path):
    import optuna

    from training import pruning

    journal = tmp_path / "search.journal"
    study = optuna.create_study(storage=pruning.storage(str(journal)), study_name="s")
    study.tell(study.ask(), 1.0)
    with open(journal, "ab") as f:
        f.write(b'{"op_code":4,"worker_id":"cut off by a crash')
    pruning._storage.cache_clear()  # a process that opens it after the crash
    again = optuna.load_study(study_name="s", storage=pruning.storage(str(journal)))
    again.tell(again.ask(), 2.0)
    pruning._storage.cache_clear()
    assert [t.value for t in optuna.load_study(study_name="s", storage=pruning.storage(str(journal))).trials] == [1.0, 2.0]


def test_a_study_kept_in_sqlite_before_the_journal_goes_on_where_it_was(tmp_path):
    """A search begun before the study's journal: its SQLite study is copied into one whole,
    trials told stay told (a pruned one's rungs with it), one running runs again."""
    import optuna

    from training.layout import CampaignFiles

    files = CampaignFiles(tmp_path)
    old = optuna.create_study(storage=f"sqlite:///{files.sqlite_study}", study_name="s", pruner=optuna.pruners.SuccessiveHalvingPruner())
    search_spec = spec(grid={"training.lr": [0.3, 0.1, 0.03]}, early_stopping={"rule": "asha", "min_steps": 20})
    for lr in (0.3, 0.1, 0.03):
        old.enqueue_trial({}, user_attrs={"point": {"training.lr": lr}, "seed_index": 0})
    done, pruned, running = old.ask(), old.ask(), old.ask()
    for trial in (done, pruned, running):
        trial.set_user_attr("trial", "drawn")
    old.tell(done, 0.5)
    pruned.report(2.0, 20)
    old._storage.set_trial_system_attr(pruned._trial_id, "completed_rung_0", 2.0)
    old.tell(pruned, state=optuna.trial.TrialState.PRUNED)

    search = Search(search_spec, tmp_path)
    assert Path(search.path) == files.study.resolve() and files.sqlite_study.exists()
    trials = search.study.trials
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "RUNNING"]
    assert trials[1].system_attrs["completed_rung_0"] == 2.0 and trials[1].intermediate_values == {20: 2.0}
    assert [d.trial.overrides["training.lr"] for d in search.unfinished()] == [0.03]
    assert not list(tmp_path.glob("*.partial"))
    files.study.write_text(files.study.read_text())  # taken over once: the journal is the study from then on
    files.sqlite_study.unlink()
    assert [t.state.name for t in Search(search_spec, tmp_path).study.trials] == ["COMPLETE", "PRUNED", "RUNNING"]


def test_under_the_median_rule_a_finished_trial_is_told_by_its_trainer_before_the_next_is_judged(tmp_path, capsys):
    """The next trial may start before the campaign's loop has collected the last one: the
    median rule counts only finished trials, so the trainer tells its own end; the loop's
    tell afterwards changes nothing. Under ASHA the loop alone tells."""
    from optuna.trial import TrialState

    from training.pruning import Pruning

    search = Search(spec(grid={"training.lr": [0.3, 0.1]}, early_stopping={"rule": "median", "min_steps": 20}), tmp_path)
    first, second = search.ask(), search.ask()
    ends, worse = Pruning(search.pruning(first)), Pruning(search.pruning(second))
    for step in (20, 40):
        assert not ends.should_stop(step, {search.metric: 0.1})
    assert not worse.should_stop(20, {search.metric: 0.9})  # nothing finished yet: nothing to compare with
    ends.finished({"pruned": False, "metrics": {search.metric: 0.1}})
    assert search.study.trials[first.number].state == TrialState.COMPLETE
    assert worse.should_stop(40, {search.metric: 0.9})  # judged against the finished one
    assert search.tell(first.number, {"pruned": False, "metrics": {search.metric: 0.5}}) == "complete"
    assert search.study.trials[first.number].value == 0.1  # told once, by the trainer
    # A tell that fails does not fail the finished trial: the loop tells the study instead.
    Pruning({**search.pruning(second), "study": "gone"}).finished({"pruned": False, "metrics": {search.metric: 0.1}})
    assert "the campaign tells it" in capsys.readouterr().err

    # Told pruned, then trained again (its result refused: a pruned trial's state at its stop is
    # not kept, so it trains from its last save): it stops at its next evaluation, the study as told.
    assert search.tell(second.number, {"pruned": True, "steps": 40, "metrics": {search.metric: 0.9}}) == "pruned"
    assert Pruning(search.pruning(second)).should_stop(30, {search.metric: 0.9})
    assert search.study.trials[second.number].state == TrialState.PRUNED

    asha = Search(spec(campaign={"name": "a"}, grid={"training.lr": [0.3]}, early_stopping={"rule": "asha", "min_steps": 20}), tmp_path)
    drawn = asha.ask()
    Pruning(asha.pruning(drawn)).finished({"pruned": False, "metrics": {asha.metric: 0.1}})
    assert asha.study.trials[drawn.number].state == TrialState.RUNNING


def test_a_grid_runs_in_the_spec_order_and_each_seed_once(tmp_path):
    search = Search(spec(grid={"training.lr": [0.3, 0.1], "model.width": [8, 16]}, early_stopping={"rule": "median"}), tmp_path)
    assert search.total == 4
    drawn = [search.ask() for _ in range(search.total)]
    assert [d.trial.overrides for d in drawn] == [{"training.lr": 0.3, "model.width": 8}, {"training.lr": 0.3, "model.width": 16},
                                                   {"training.lr": 0.1, "model.width": 8}, {"training.lr": 0.1, "model.width": 16}]
    assert search.remaining() == 0

    seeded = Search(spec(search={"strategy": "random", "trials": 2, "seeds": 3, "space": {"training.lr": {"log_uniform": [1e-3, 1]}}},
                         campaign={"name": "seeded", "seed": 7}), tmp_path)
    assert seeded.total == 6
    drawn = [seeded.ask() for _ in range(6)]
    assert [d.trial.spec.seed for d in drawn] == [7, 8, 9, 7, 8, 9]  # each point, then its repeats
    assert drawn[0].trial.overrides == drawn[2].trial.overrides != drawn[3].trial.overrides
    assert len({d.trial.id for d in drawn}) == 6


@pytest.mark.parametrize("strategy", ["random", "sobol", "tpe"])
def test_a_restarted_search_goes_on_where_it_was(tmp_path, strategy):
    """What was told stays; what was drawn and not told is handed back to run again; new
    draws are new points (a reseeded sampler does not replay the first draws)."""
    the_spec = spec(search={"strategy": strategy, "trials": 6, "space": {"training.lr": {"log_uniform": [1e-4, 1.0]},
                                                                           "model.width": {"int_uniform": [4, 64]}}})
    first = Search(the_spec, tmp_path)
    a, b, c = first.ask(), first.ask(), first.ask()
    first.tell(a.number, {"metrics": {"val_loss": 0.5}})
    first.tell(b.number, {"metrics": {"val_loss": 0.9}, "pruned": True})
    # The campaign dies here, c still running. A new process opens the same study:
    again = Search(the_spec, tmp_path)
    assert [d.trial.id for d in again.unfinished()] == [c.trial.id]
    assert again.drawn() == 3 and again.remaining() == 3
    later = [again.ask() for _ in range(3)]
    earlier = {json.dumps(d.trial.overrides, sort_keys=True) for d in (a, b, c)}
    assert not earlier & {json.dumps(d.trial.overrides, sort_keys=True) for d in later}
    assert again.remaining() == 0
    states = sorted(t.state.name for t in again.study.trials)
    assert states == ["COMPLETE", "PRUNED", "RUNNING", "RUNNING", "RUNNING", "RUNNING"]


@pytest.mark.parametrize("strategy", ["random", "tpe"])
def test_a_draw_cut_short_by_a_kill_is_finished_when_the_search_goes_on(tmp_path, strategy):
    """Optuna's ask stores the trial before its values: a campaign killed between the two
    leaves a running trial with no point. Opened again, the search draws its values then
    (within the space) and runs it as its own point, not the spec's defaults."""
    the_spec = spec(search={"strategy": strategy, "trials": 3, "space": {"training.lr": {"log_uniform": [1e-4, 1e-2]},
                                                                           "model.width": {"int_uniform": [4, 8]}}})
    first = Search(the_spec, tmp_path)
    done = first.ask()
    first.study.ask()  # the kill lands here: the trial is stored, none of its values
    again = Search(the_spec, tmp_path)
    (_, cut) = sorted(again.unfinished(), key=lambda d: d.number)
    assert (cut.number, again.remaining()) == (done.number + 1, 1)
    lr, width = cut.trial.overrides["training.lr"], cut.trial.overrides["model.width"]
    assert 1e-4 <= lr <= 1e-2 and 4 <= width <= 8  # its own point, drawn now (the spec's lr is 0.1)
    assert again.study.trials[cut.number].params == {"training.lr": lr, "model.width": width}
    assert cut.trial.id in [d.trial.id for d in Search(the_spec, tmp_path).unfinished()]  # the same trial the next time


@pytest.mark.parametrize("bad, culprit", [
    ({"search": {"strategy": "tpe", "space": {"training.lr": {"uniform": [0.1, 0.2]}}}}, "search.trials is required"),
    ({"search": {"trials": 4, "space": {"training.lr": {"normal": [0, 1]}}}}, "a search dimension is one of"),
    ({"search": {"trials": 4, "space": {"training.lr": {"uniform": [0.5, 0.1]}}}}, "needs low < high"),
    ({"search": {"trials": 4, "space": {"training.lr": {"log_uniform": [0, 1]}}}}, "log_uniform.0: Input should be greater than 0"),
    ({"search": {"trials": 4, "space": {"training.nope": {"uniform": [0.1, 1]}}}}, "training has no field 'nope'"),
    ({"search": {"trials": 4, "space": {"training.batch_size": {"int_uniform": [0, 64]}}}}, r"batch_size\[0\] = 0"),
    ({"search": {"strategy": "grid", "space": {"training.lr": {"uniform": [0.1, 1]}}}}, "grid takes only `choice`"),
    ({"grid": {"training.lr": [0.1]}, "search": {"trials": 2, "space": {"training.lr": {"uniform": [0.1, 1]}}}}, "give one"),
    ({"early_stopping": {"rule": "sometimes"}}, "early_stopping.rule"),
    ({"early_stopping": {"rule": "asha", "reduction_factor": 1}}, "reduction_factor"),
    ({"training": {**BASE["training"], "eval_every": 500}, "early_stopping": {"rule": "asha"}}, "needs evaluations"),
])
def test_bad_search_specs_exit_2_naming_the_field(tmp_path, digits_npz, bad, culprit):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({**BASE, "data": {"path": str(digits_npz)}, **bad,
                                                          "tracking": {"runs_dir": "runs"}}))
    done = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert culprit.replace("\\", "") in done.stderr or __import__("re").search(culprit, done.stderr), done.stderr
    assert not (tmp_path / "runs").exists()


# --- real campaigns -------------------------------------------------------------------------

def write_params(folder: Path, digits: Path, name: str, **sections) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": name}, "data": {"path": str(digits)}, "model": {"name": "small_cnn", "width": 8},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"), "summary": str(folder / "s.json")},
        **sections,
    }))


def events(folder: Path, name: str) -> list[tuple[str, str]]:
    lines = (folder / "runs" / name / "allocations.jsonl").read_text().splitlines()
    return [(e["trial"], e["reason"]) for e in map(json.loads, lines)]


@pytest.mark.slow
def test_a_pruned_trial_hands_its_device_to_the_next(tmp_path, digits_npz):
    """A grid on one slot with the median rule: the hopeless learning rate is stopped at an
    evaluation, recorded as pruned (result, status, MLflow), and the next trial gets its slot."""
    from mlflow import MlflowClient

    from tasks.records import campaign_status

    # The grid runs (log_every 30: lr 0.1, 1e-5), then (60: 0.1, 1e-5). The second lr 0.1 trains
    # exactly what the first does (log_every changes no number): the median rule (worse than
    # the completed trials at the same step) keeps it. The hopeless ones are stopped at their
    # first evaluation from min_steps on.
    write_params(tmp_path, digits_npz, "prune", grid={"training.lr": [0.1, 0.00001], "training.log_every": [30, 60]},
                 training={"steps": 300, "batch_size": 32, "lr": 0.05, "eval_every": 30, "checkpoint_every": 30},
                 early_stopping={"rule": "median", "min_steps": 60})
    done = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2/4 trials, 2 pruned" in done.stdout
    status = {row.trial_id: row for row in campaign_status(tmp_path / "runs", "prune")}
    hopeless = sorted(t for t in status if "lr1e-05" in t)
    assert [status[t].state for t in hopeless] == ["pruned", "pruned"] and all(status[t].step == 60 for t in hopeless)
    result = json.loads((tmp_path / "runs" / "prune" / hopeless[0] / "result.json").read_text())
    # Stopped at step 60, its state there not written (a pruned trial is final): the result points at the save before.
    assert result["pruned"] and result["steps"] == 60 and Path(result["checkpoint"]).name == "step-00000030"
    assert not (tmp_path / "runs" / "prune" / hopeless[0] / "checkpoints" / "step-00000060").exists()
    order = events(tmp_path, "prune")
    first_pruned = next(i for i, (trial, reason) in enumerate(order) if trial in hopeless and reason == "end")
    assert order[first_pruned + 1] == ("log_every60-lr0.1-" + order[first_pruned + 1][0].rsplit("-", 1)[1], "start")  # its slot, to the next
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("campaigns").experiment_id], "tags.`campaign.kind` = 'trial'")
    assert sorted(r.data.tags["campaign.state"] for r in runs) == ["finished", "finished", "pruned", "pruned"]

    # Its result refused (unsigned), a launch trains it again from that save: the study, told it
    # was pruned, stops it at its next evaluation again; the other three are not run again.
    path = tmp_path / "runs" / "prune" / hopeless[0] / "result.json"
    path.write_text(json.dumps({k: v for k, v in result.items() if k != "hmac"}))
    again = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "it is not signed" in again.stdout + again.stderr
    redone = json.loads(path.read_text())
    assert redone["pruned"] and redone["resumed_from_step"] == 30 and "hmac" in redone, again.stdout + again.stderr
    assert "2/4 trials, 2 pruned" in again.stdout
    assert [trial for trial, reason in events(tmp_path, "prune")[len(order):] if reason == "start"] == [hopeless[0]]


@pytest.mark.slow
def test_a_search_killed_outright_goes_on_to_n_without_rerunning(tmp_path, digits_npz):
    """SIGKILL while the second of four drawn trials trains; `campaign launch` again: the
    first stays as it is, the second resumes from its checkpoint, two more are drawn, and
    the study holds four complete trials."""
    import optuna

    write_params(tmp_path, digits_npz, "killed",
                 training={"steps": 400, "batch_size": 32, "lr": 0.05, "eval_every": 200, "checkpoint_every": 100, "log_every": 100},
                 search={"strategy": "random", "trials": 4, "space": {"training.lr": {"log_uniform": [0.01, 0.2]}}})
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "CAMPAIGN_HOLD_AT_STEP": "300"})
    root = tmp_path / "runs" / "killed"
    deadline = time.time() + 300
    while len(first := [p.parent.name for p in root.glob("*/result.json")]) < 1:  # the first trial ran through
        assert proc.poll() is None and time.time() < deadline, "the first trial never finished"
        time.sleep(0.05)
    second = None
    while second is None or (json.loads((root / second / "progress.json").read_text() or "{}")
                             if (root / second / "progress.json").exists() else {}).get("state") != "held":
        dirs = [p.name for p in root.iterdir() if p.is_dir() and p.name not in first]
        if dirs and second is None:
            second = dirs[0]
            trial_files(root / second).hold.touch()  # it waits before step 300: the kill lands mid-trial
        assert proc.poll() is None and time.time() < deadline, "the second trial never reached its hold step"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(2)  # the warden ends what the campaign left
    trial_files(root / second).hold.unlink()

    done = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    starts = [trial for trial, reason in events(tmp_path, "killed") if reason == "start"]
    assert starts.count(first[0]) == 1  # completed before the kill: not run again
    assert len(set(starts)) == 4 and len(starts) == 5  # the interrupted one started twice, two new ones once
    resumed = [t for t in set(starts) if starts.count(t) == 2][0]
    assert resumed == second
    resumed_from = json.loads((root / resumed / "result.json").read_text())["resumed_from_step"]
    assert resumed_from >= 100
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("campaigns").experiment_id], f"tags.`campaign.trial_id` = '{resumed}'")
    assert Path(run.data.tags[f"resume.step-{resumed_from}"]).name == f"step-{resumed_from:08d}"  # which checkpoint it used
    study = optuna.load_study(study_name="killed", storage=storage(str(CampaignFiles(root).study)))
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE"] * 4
    assert len({t.params["training.lr"] for t in study.trials}) == 4
