"""The campaign's view in MLflow's UI (tasks/tracking.py: campaign_view): its trials as rows, the
metric it ranks by and the parameters it varies as columns, best first; in the charts, that
metric's curves first. The browser test (tests/test_ui.py) opens it in MLflow's own UI."""

from __future__ import annotations

import json

from mlflow import MlflowClient

from tasks.summary import ranked_by, varied_params, summary_markdown
from tasks.tracking import VIEW_TAG_PREFIX, campaign_view, campaign_view_url, save_campaign_view
from training.spec import CampaignSpec


def spec_of(**sections) -> CampaignSpec:
    return CampaignSpec.model_validate({"campaign": {"name": "c"}, "data": {"path": "d.npz"}, "model": {"name": "mlp"},
                                     "training": {"steps": 10, "batch_size": 8, "lr": 0.1}, **sections})


def test_a_grid_ranks_by_validation_accuracy_and_a_search_by_its_objective():
    grid = spec_of(grid={"training.lr": [0.1, 0.2], "model.width": [8, 16]})
    assert ranked_by(grid) == ("val_accuracy", "max") and varied_params(grid) == ["training.lr", "model.width"]
    search = spec_of(search={"strategy": "random", "trials": 4, "metric": "val_loss", "mode": "min",
                             "space": {"training.lr": {"log_uniform": [0.001, 0.1]}}})
    assert ranked_by(search) == ("val_loss", "min") and varied_params(search) == ["training.lr"]


def test_the_view_shows_only_the_campaigns_trials_best_first_with_its_metric_and_parameters():
    view = campaign_view("digits", "val_loss", "min", ["training.lr", "model.width"])
    # Only trial runs: without their parent in the results MLflow lists each one as a row of its own.
    assert view["searchFilter"] == "tags.`campaign.name` = 'digits' and tags.`campaign.kind` = 'trial'"
    assert (view["orderByKey"], view["orderByAsc"]) == ("metrics.`val_loss`", True)  # min: the lowest first
    assert view["selectedColumns"] == ["metrics.`val_loss`", "metrics.`val_accuracy`", "metrics.`train_loss`",
                                       "params.`training.lr`", "params.`model.width`"]
    charts = view["compareRunCharts"]
    assert [c["metricKey"] for c in charts] == ["val_loss", "val_accuracy", "train_loss"]  # the campaign's metric first
    assert {c["metricSectionId"] for c in charts} == {view["compareRunSections"][0]["uuid"]}
    assert [s["name"] for s in view["compareRunSections"]] == ["Model metrics", "System metrics"]
    assert campaign_view("d", "val_accuracy", "max", [])["orderByAsc"] is False


def test_the_view_is_saved_on_the_experiment_and_the_links_open_it(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("e")
    save_campaign_view(uri, experiment, "digits", "val_accuracy", "max", ["training.lr"])
    saved = json.loads(client.get_experiment(experiment).tags[VIEW_TAG_PREFIX + "campaign-digits"])
    assert saved == campaign_view("digits", "val_accuracy", "max", ["training.lr"])
    # The URL carries no search of its own (the page would then ignore the saved view), only the mode.
    assert campaign_view_url("http://127.0.0.1:5000/", experiment, "digits") == \
        f"http://127.0.0.1:5000/#/experiments/{experiment}/runs?viewStateShareKey=campaign-digits&compareRunsMode=TABLE"
    assert campaign_view_url("http://h:1", "3", "digits", charts=True).endswith("compareRunsMode=CHART")


def test_the_summary_artifact_links_the_campaigns_view_when_a_ui_is_known():
    summary = {"trials": 1, "finished": 1, "failed": 0, "per_trial": {}}
    trial = type("T", (), {"id": "t1", "label": "lr=0.1"})()
    linked = summary_markdown("c", summary, [trial], {"t1": "finished"}, {"t1": "abc"}, "http://127.0.0.1:5001", "7")
    assert f"[every trial, best first]({campaign_view_url('http://127.0.0.1:5001', '7', 'c')})" in linked
    assert f"[their curves]({campaign_view_url('http://127.0.0.1:5001', '7', 'c', charts=True)})" in linked
    assert "every trial" not in summary_markdown("c", summary, [trial], {"t1": "finished"}, {"t1": "abc"})
