"""The campaign writes only files it owns: every output path the spec names is new or the campaign's own.

`tracking.summary` is replaced whole at a campaign's end; pointed at params.yaml, a dataset or
a file outside the project it would have replaced it. A launch now refuses (exit 2, naming the
path and the fix) before anything runs unless the file is absent or a summary this campaign
wrote (its name and `"written_by": "campaign"`, or an older summary's exact fields). The same
holds for the runs folder and its `latest` pointer (the MLflow store: tasks/tracking_store.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tasks.grid import expand_grid
from tasks.summary import write_summary
from training.errors import CampaignError
from training.spec import SpecError, check_outputs, check_tracking, load_spec, parse_spec

REPO = Path(__file__).resolve().parent.parent


def spec_in(folder: Path, name: str = "owned", **tracking) -> dict:
    return {"campaign": {"name": name},
            "data": {"path": "data/digits.npz"},
            "model": {"name": "small_cnn", "width": 8},
            "training": {"steps": 20, "batch_size": 16, "lr": 0.1},
            "grid": {"training.lr": [0.1, 0.2]},
            "resources": {"devices": 1},
            "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"),
                         "summary": str(folder / "metrics" / f"{name}.json"), **tracking}}


@pytest.fixture(autouse=True)
def no_tracking_server(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def refusal(raw: dict) -> str:
    return " ".join(str(pytest.raises(SpecError, check_outputs, parse_spec(raw)).value).split())


@pytest.mark.parametrize("content", [
    "campaign: {name: mine}\n",  # a params.yaml
    '{"accuracy": 0.9}\n',  # someone's JSON
    '{"campaign": "other", "written_by": "campaign", "trials": 1, "finished": 1, "failed": 0, "per_trial": {}}\n',  # another campaign's
])
def test_a_summary_path_holding_another_file_is_refused_and_left_alone(tmp_path, content):
    target = tmp_path / "elsewhere" / "file.json"
    target.parent.mkdir()
    target.write_text(content)
    message = refusal(spec_in(tmp_path, summary=str(target)))
    assert f"tracking.summary: {target} exists" in message and "Point tracking.summary at a new file" in message, message
    assert target.read_text() == content


def test_the_campaigns_own_summary_is_accepted_and_rewritten(tmp_path):
    spec = parse_spec(spec_in(tmp_path))
    check_outputs(spec)  # new
    trials = expand_grid(spec)
    write_summary(spec, trials, {trials[0].id: {"metrics": {"val_accuracy": 0.5, "val_loss": 1.0}}}, {})
    written = json.loads(spec.tracking.summary.read_text())
    assert written["campaign"] == "owned" and written["written_by"] == "campaign" and written["finished"] == 1
    check_outputs(spec)  # the campaign's own, from an earlier launch
    write_summary(spec, trials, {}, {trials[1].id: "boom"})
    assert json.loads(spec.tracking.summary.read_text())["failed"] == 1


def test_a_summary_written_before_the_marker_is_still_the_campaigns(tmp_path, monkeypatch):
    """A summary `make campaign` wrote before summaries carried "written_by" (and before each
    trial's figures had a file of their own): its fields say it is the campaign's."""
    monkeypatch.chdir(REPO)
    spec = load_spec(REPO / "params.yaml")
    check_outputs(spec)  # the repository's own, as `make campaign` writes it now
    older = {"best": {"trial": "lr0.1-width16-1d6bd000", "val_accuracy": 0.99164}, "campaign": "digits-cnn", "failed": 0,
             "finished": 4, "per_trial": {"lr0.1-width16-1d6bd000": {"val_accuracy": 0.99164}}, "pruned": 0, "trials": 4}
    copy = tmp_path / "campaign.json"
    copy.write_text(json.dumps(older, indent=2))
    check_outputs(parse_spec({**spec_in(tmp_path, name="digits-cnn", summary=str(copy))}))  # accepted: its fields and name
    assert "summary of campaign 'digits-cnn'" in refusal(spec_in(tmp_path, name="renamed", summary=str(copy)))


def test_the_summary_is_not_written_over_a_file_put_there_during_the_campaign(tmp_path):
    spec = parse_spec(spec_in(tmp_path))
    spec.tracking.summary.parent.mkdir()
    spec.tracking.summary.write_text("notes\n")
    with pytest.raises(CampaignError, match="left as it is"):
        write_summary(spec, expand_grid(spec), {}, {})
    assert spec.tracking.summary.read_text() == "notes\n"


def test_each_trials_figures_go_beside_the_summary_and_a_foreign_file_there_is_refused(tmp_path):
    """`dvc metrics show` reads a row per file: the trials' files sit in <summary>-trials/, whose
    stale files (a trial no longer in the grid) are removed; a file the campaign did not write there
    is never removed: the launch is refused naming it."""
    spec = parse_spec(spec_in(tmp_path))
    trials = expand_grid(spec)
    results = {t.id: {"metrics": {"val_accuracy": 0.5, "val_loss": 1.0, "other": 3.0}} for t in trials}
    folder = spec.tracking.summary.with_name(spec.tracking.summary.stem + "-trials")
    folder.mkdir(parents=True)
    (folder / "gone.json").write_text('{"val_accuracy": 0.1}')  # a trial of an earlier grid
    write_summary(spec, trials, results, {})
    assert {p.stem for p in folder.iterdir()} == {t.id for t in trials}
    assert json.loads((folder / f"{trials[0].id}.json").read_text()) == {"val_accuracy": 0.5, "val_loss": 1.0}
    assert "per_trial" not in json.loads(spec.tracking.summary.read_text())
    (folder / "notes.txt").write_text("mine\n")
    assert "notes.txt, which is not a trial's figures" in refusal(spec_in(tmp_path))
    with pytest.raises(CampaignError, match="left as it is"):
        write_summary(spec, trials, results, {})
    assert (folder / "notes.txt").read_text() == "mine\n"


def test_a_runs_folder_that_is_a_file_or_a_latest_pointer_that_is_not_a_name_is_refused(tmp_path):
    (tmp_path / "runs").write_text("mine\n")
    assert "tracking.runs_dir: " in refusal(spec_in(tmp_path)) and (tmp_path / "runs").read_text() == "mine\n"
    (tmp_path / "runs").unlink()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "latest").write_text("not a name\nat all\n")
    assert "runs/latest exists and does not hold the name" in refusal(spec_in(tmp_path))
    (tmp_path / "runs" / "latest").write_text("digits-cnn\n")  # what a launch writes
    check_outputs(parse_spec(spec_in(tmp_path)))


@pytest.mark.parametrize("where", ["params.yaml", "outside"])
def test_launch_refuses_a_summary_over_a_file_it_did_not_write(tmp_path, digits_npz, where):
    """`campaign launch` with tracking.summary at its own params.yaml, or at a file outside the
    project: exit 2 naming the file, which is left as it was, and nothing else written."""
    from conftest import campaign_cli

    project = tmp_path / "project"
    project.mkdir()
    outside = tmp_path / "notes.txt"
    outside.write_text("mine\n")
    raw = spec_in(project, summary="params.yaml" if where == "params.yaml" else str(outside))
    raw["data"]["path"] = str(digits_npz)
    raw["cluster"] = {"cpu_slots": 2}
    (project / "params.yaml").write_text(text := yaml.safe_dump(raw))
    result = campaign_cli("launch", "params.yaml", cwd=project)
    output = " ".join((result.stdout + result.stderr).split())  # rich wraps long lines
    assert result.returncode == 2, output
    named = "params.yaml" if where == "params.yaml" else str(outside)
    assert f"tracking.summary: {named} exists" in output, output
    assert (project / "params.yaml").read_text() == text and outside.read_text() == "mine\n"
    assert sorted(p.name for p in project.iterdir()) == ["params.yaml"]  # nothing half-written


def test_check_tracking_runs_the_output_checks(tmp_path):
    target = tmp_path / "params.yaml"
    target.write_text("campaign: {name: x}\n")
    with pytest.raises(SpecError, match="tracking.summary"):
        check_tracking(parse_spec(spec_in(tmp_path, summary=str(target))))
