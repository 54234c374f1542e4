"""A trial's result.json is signed like a checkpoint's manifest and checked on every read
(training/result.py): a forged, unsigned or malformed one is named in a warning and read as
no result, `campaign status` shows the trial as it is (never a traceback), and the next
launch re-finalises it from its verified final checkpoint without training a step.

Fast tests: the record's checks, one at a time, and `campaign status` on bad results. The
slow one: a real campaign whose results are forged and broken after it ran.
"""

from __future__ import annotations

import json
import math

import pytest
import yaml

from conftest import campaign_cli
from tasks.records import CampaignRecord, TrialEntry, completed_result, trial_status, update_record, write_campaign
from tasks.summary import summarize
from training.files import write_json_atomic
from training.result import RESULT_SCHEMA, read_result, result_problem, signed_result, write_result


def trainer_result(trial_id: str = "t1", steps: int = 20, **changes) -> dict:
    """Every field the project's trainer writes (training/trainer.py), as it writes them."""
    return {"trial_id": trial_id, "steps": steps, "samples_seen": steps * 16, "scaling": "fixed", "world_size": 2,
            "pruned": False, "resumed_from_step": 10, "wall_s": 3.25,
            "metrics": {"val_accuracy": 0.8125, "val_loss": 0.4321, "train_loss": 0.5, "lr": 0.05, "step_time_s": 0.01},
            "checkpoint": f"/runs/c/{trial_id}/checkpoints/step-{steps:08d}", "peak_device_memory_bytes": 123456789,
            "device_memory": {"after_setup": 1000, "large_pool_peak": 2000, "small_pool_peak": 30, "reserved_peak": 4096},
            **changes}


def test_a_signed_result_reads_back_field_for_field(tmp_path):
    trial_dir = tmp_path / "t1"
    trial_dir.mkdir()
    written = write_result(trial_dir / "result.json", trainer_result())
    read = read_result(trial_dir)
    assert read == written and read is not None
    for name, value in trainer_result().items():
        assert read[name] == value and type(read[name]) is type(value), name
    assert read["schema"] == RESULT_SCHEMA and len(read["hmac"]) == 64
    # A function trial's result (no device fields; the function's name; a save before its last report).
    function = {"trial_id": "t1", "steps": 95, "samples_seen": 0, "scaling": "fixed", "world_size": 1, "pruned": True,
                "resumed_from_step": 0, "wall_s": 1.0, "metrics": {"reward": 7.0}, "checkpoint": "/x/step-00000090",
                "function": "mylab.loop:fit"}
    write_result(trial_dir / "result.json", function)
    assert {k: v for k, v in read_result(trial_dir).items() if k not in ("schema", "hmac")} == function
    assert trial_status(trial_dir, "t1", "x", 100).state == "pruned"


def test_a_metric_that_is_not_a_finite_number_is_named_not_written(tmp_path):
    """A diverged loss (NaN) has no JSON form a reader takes: it is left out of the metrics and
    named, so the result stays one that reads back (the trial is not re-finalised forever)."""
    written = write_result(tmp_path / "result.json", trainer_result("t", metrics={"val_loss": math.nan, "train_loss": math.inf,
                                                                                  "val_accuracy": 0.1}))
    assert written["metrics"] == {"val_accuracy": 0.1} and written["nonfinite_metrics"] == ["train_loss", "val_loss"]
    assert read_result(tmp_path, "t") == written


FORGERIES = {
    # what is changed after signing (or how the file is made) -> what the warning says
    "the values changed": (lambda r: {**r, "metrics": {**r["metrics"], "val_accuracy": 1.0, "val_loss": -5.0}},
                           "its signature does not match this host's checkpoint key"),
    "unsigned, as before results were signed": (lambda r: {k: v for k, v in r.items() if k not in ("hmac", "schema")},
                                                "it is not signed"),
    "a metric that is text": (lambda r: {**r, "metrics": {**r["metrics"], "val_accuracy": "high"}},
                              "metric 'val_accuracy' is 'high', not a finite number"),
    "a metric that is NaN": (lambda r: {**r, "metrics": {**r["metrics"], "val_loss": math.nan}}, "metric 'val_loss' is 'nan'"),
    "a metric that is true": (lambda r: {**r, "metrics": {**r["metrics"], "val_accuracy": True}}, "metric 'val_accuracy' is 'True'"),
    "metrics that are a list": (lambda r: {**r, "metrics": [1.0]}, r"metrics is '\[1.0\]', not an object"),
    "steps that are text": (lambda r: {**r, "steps": "20"}, "steps is '20', not a whole number"),
    "another trial's result": (lambda r: signed_result(trainer_result("t2")), "it is trial 't2''s result, not 't1''s"),
    "a step its checkpoint is not": (lambda r: {**r, "steps": 30}, "checkpoint '/runs/c/t1/checkpoints/step-00000020' is not the final checkpoint of step 30"),
    "a field no writer writes": (lambda r: {**r, "best": True}, r"unknown fields \['best'\]"),
    "a newer schema": (lambda r: {**r, "schema": 9}, "schema 9"),
    "a signature that is not hex": (lambda r: {**r, "hmac": "é" * 64}, "its signature does not match"),
    "a number too large for a float": (lambda r: {**r, "metrics": {"val_accuracy": 10 ** 400}}, "its signature does not match"),
    "not an object": (lambda r: [r], "not a JSON object"),
}


@pytest.mark.parametrize("checkpoint, problem", [
    ("/runs/c/t1/checkpoints/step-00000030", None),  # the save before its stop
    ("", None),  # stopped before its first save
    ("/runs/c/t1/checkpoints/step-00000060", "is not a save at or before step 40"),
])
def test_a_pruned_result_names_a_save_at_or_before_its_stop(checkpoint, problem):
    """A pruned trial is final: its state at the stop is not written, so its result names the
    last save (or none); a save past its stop is still refused."""
    result = trainer_result(steps=40, pruned=True, checkpoint=checkpoint)
    if problem is None:
        assert result_problem(signed_result(result), "t1") is None
    else:
        with pytest.raises(ValueError, match=problem):
            signed_result(result)
    unpruned = {**result, "pruned": False}  # a trial that ran to its end names its last step's
    with pytest.raises(ValueError, match="is not the final checkpoint of step 40"):
        signed_result(unpruned)


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_unsigned_or_malformed_result_is_named_and_read_as_none(tmp_path, forgery):
    change, why = FORGERIES[forgery]
    trial_dir = tmp_path / "t1"
    trial_dir.mkdir()
    path = trial_dir / "result.json"
    path.write_text(json.dumps(change(signed_result(trainer_result()))))
    with pytest.warns(UserWarning, match=f"ignoring {path}: {why}.*re-finalises the trial from its final checkpoint"):
        assert completed_result(trial_dir) is None
    status = trial_status(trial_dir, "t1", "x", 20)
    assert status.metrics == {} and status.step == 0 and status.reason.startswith(f"result refused: {path}: ")
    assert result_problem(change(signed_result(trainer_result())), "t1") is not None


def test_a_forged_best_trial_is_not_the_best(tmp_path):
    """Only results that read back reach the summary: a forged 1.0 is not among them."""
    from tasks.grid import Trial

    genuine, forged = tmp_path / "t1", tmp_path / "t2"
    for folder in (genuine, forged):
        folder.mkdir()
    write_result(genuine / "result.json", trainer_result("t1"))
    fake = signed_result(trainer_result("t2", metrics={"val_accuracy": 0.5}))
    write_json_atomic(forged / "result.json", {**fake, "metrics": {"val_accuracy": 1.0, "val_loss": -5.0}})
    with pytest.warns(UserWarning, match=f"ignoring {forged / 'result.json'}: its signature does not match"):
        results = {p.name: r for p in (genuine, forged) if (r := completed_result(p)) is not None}
    trials = [Trial(id=i, label=i, overrides={}, spec=None) for i in ("t1", "t2")]
    summary = summarize(trials, results, {})
    assert summary["best"] == {"trial": "t1", "val_accuracy": 0.8125} and "t2" not in summary["per_trial"]


def test_status_shows_a_trial_with_a_bad_result_as_it_is_never_a_traceback(tmp_path):
    """A string metric used to end `campaign status` in a traceback (its table formats numbers);
    a forged result was shown as finished with its numbers. Both are shown by their record's
    state (a finished one as unverified), the file and what is wrong on the line under the table."""
    runs = tmp_path / "runs"
    write_campaign(runs, CampaignRecord(name="c", trials=(TrialEntry("t1", "a", 20), TrialEntry("t2", "b", 20),
                                                          TrialEntry("t3", "c", 20))))
    for trial in ("t1", "t2", "t3"):
        (runs / "c" / trial).mkdir(parents=True)
    write_json_atomic(runs / "c" / "t1" / "result.json", {**signed_result(trainer_result("t1")),
                                                          "metrics": {"val_accuracy": "high"}})
    update_record(runs / "c" / "t2", state="finished")
    write_json_atomic(runs / "c" / "t2" / "result.json", {**signed_result(trainer_result("t2")),
                                                          "metrics": {"val_accuracy": 1.0, "val_loss": -5.0}})
    write_result(runs / "c" / "t3" / "result.json", trainer_result("t3"))
    shown = campaign_cli("status", "c", "--runs-dir", str(runs), cwd=tmp_path)
    assert shown.returncode == 0 and "Traceback" not in shown.stdout + shown.stderr, shown.stdout[-3000:] + shown.stderr[-3000:]
    output = " ".join(shown.stdout.split())
    assert f"trial t1 pending: result refused: {runs / 'c' / 't1' / 'result.json'}: metric 'val_accuracy' is 'high'" in output, output
    assert f"trial t2 unverified: result refused: {runs / 'c' / 't2' / 'result.json'}: its signature does not match" in output
    assert "1.0000" not in output and "0.8125" in output  # t3's genuine accuracy, no forged one
    assert "UserWarning" not in shown.stderr


@pytest.mark.slow
def test_a_forged_and_a_broken_result_are_refinalised_from_their_checkpoints_on_launch(tmp_path, digits_npz):
    """Two trials ran to their end; then one's result is forged (accuracy 1.0, loss -5, so it
    would be the best) and the other's has a metric that is text. `campaign status` names both
    files; the next launch warns about both, resumes each from its verified final checkpoint
    without training a step, and writes their true results again, signed: the summary's best
    is the trial that was best."""
    runs = tmp_path / "runs"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "forged"}, "data": {"path": str(digits_npz)}, "model": {"name": "small_cnn", "width": 4},
        "training": {"steps": 20, "batch_size": 16, "lr": 0.05, "checkpoint_every": 10, "eval_every": 10},
        "grid": {"training.lr": [0.05, 0.001]},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(runs), "summary": str(tmp_path / "s.json")},
    }))
    first = campaign_cli("launch", "params.yaml", "--no-live", cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    true = {p.name: json.loads((p / "result.json").read_text()) for p in (runs / "forged").iterdir() if p.is_dir()}
    best = json.loads((tmp_path / "s.json").read_text())["best"]["trial"]
    (loser,) = set(true) - {best}
    write_json_atomic(runs / "forged" / loser / "result.json",
                      {**true[loser], "metrics": {**true[loser]["metrics"], "val_accuracy": 1.0, "val_loss": -5.0}})
    write_json_atomic(runs / "forged" / best / "result.json", {**true[best], "metrics": {"val_accuracy": "high"}})

    shown = campaign_cli("status", "forged", "--runs-dir", str(runs), cwd=tmp_path)
    output = " ".join(shown.stdout.split())
    assert shown.returncode == 0 and "Traceback" not in shown.stdout + shown.stderr, shown.stderr[-3000:]
    assert f"trial {loser} unverified: result refused: {runs / 'forged' / loser / 'result.json'}: its signature" in output, output
    assert f"trial {best} unverified: result refused: {runs / 'forged' / best / 'result.json'}: metric 'val_accuracy'" in output, output

    again = campaign_cli("launch", "params.yaml", "--no-live", cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    said = " ".join((again.stdout + again.stderr).split())
    assert f"ignoring {runs / 'forged' / loser / 'result.json'}: its signature does not match" in said, said[-3000:]
    for trial, result in true.items():
        now = read_result(runs / "forged" / trial)
        assert now is not None and now["steps"] == 20 and now["resumed_from_step"] == 20  # not a step trained again
        assert now["checkpoint"] == result["checkpoint"]
        for metric in ("val_accuracy", "val_loss"):
            assert now["metrics"][metric] == pytest.approx(result["metrics"][metric], rel=1e-6), (trial, metric)
        assert "resumed at step 20 from" in (runs / "forged" / trial / "train.log").read_text()
    assert json.loads((tmp_path / "s.json").read_text())["best"]["trial"] == best
    assert all(completed_result(runs / "forged" / t) is not None for t in true)
