"""The spec fails early and clearly: field path, what would be valid, exit code 2, no files."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from training.spec import SpecError, load_spec, parse_spec
from tasks.grid import expand_grid

GOOD = {
    "campaign": {"name": "t", "seed": 0},
    "data": {"path": "data/digits.npz"},
    "model": {"name": "small_cnn", "width": 8},
    "training": {"steps": 20, "batch_size": 16, "lr": 0.1},
    "grid": {"training.lr": [0.1, 0.2], "model.width": [4, 8]},
    "resources": {"devices": 1},
}


def with_change(path: str, value, base=GOOD):
    raw = copy.deepcopy(base)
    *parents, last = path.split("/")
    node = raw
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return raw


DELETE = object()

BAD = [
    # (change, value, words the error must contain)
    ("campaign/name", DELETE, ["campaign.name", "Field required"]),
    ("campaign/name", "has space", ["campaign.name", "pattern"]),
    ("campaign/seed", -1, ["campaign.seed", "greater than or equal to 0"]),
    ("campaign/colour", "red", ["campaign.colour", "Extra inputs"]),
    ("model/name", "resnet9000", ["model", "small_cnn", "mlp"]),
    ("model/width", 0, ["model.width", "greater than or equal to 1"]),
    ("model/depth", 3, ["model.depth", "Extra inputs"]),  # small_cnn has no depth
    ("model/widht", 3, ["model.widht", "Extra inputs", "did you mean 'width'?"]),  # inside the model union's variant
    ("training/lrr", 0.1, ["training.lrr", "did you mean 'lr'?"]),
    ("clustre", {"cpu_slots": 2}, ["clustre", "did you mean 'cluster'?"]),  # a section
    ("model/dropout", 1.5, ["model.dropout", "less than 1"]),
    ("training/steps", 0, ["training.steps", "greater than or equal to 1"]),
    ("training/steps", "many", ["training.steps", "valid integer"]),
    ("training/lr", -0.1, ["training.lr", "greater than 0"]),
    ("training/batch_size", DELETE, ["training.batch_size", "Field required"]),
    ("training/schedule", "linear", ["training.schedule", "cosine", "constant"]),
    ("training/warmup_steps", 50, ["warmup_steps (50) must be smaller than steps (20)"]),
    ("training/checkpoint_every", 0, ["training.checkpoint_every"]),
    ("grid", {"training.lr": []}, ["grid", "empty"]),
    ("grid", {"scheduler.lr": [1]}, ["grid key 'scheduler.lr'", "model, data, training, optimizer, loss"]),
    ("grid", {"training.steps.x": [1]}, ["grid.training.steps.x", "not a mapping"]),
    ("grid", {"optimizer.kwargs.momentum": [0.5, 0.5]}, ["repeats a value"]),
    ("training/momentum", 0.9, ["training.momentum moved to the optimizer", "optimizer: {name: SGD, kwargs: {momentum: 0.9}}"]),
    ("training/reduction", "approximate", ["training.reduction", "fast", "exact"]),
    ("training/precision", "fp8", ["training.precision", "bf16", "fp16"]),
    ("training/grad_clip_norm", 0, ["training.grad_clip_norm", "greater than 0"]),
    ("training/logical_ranks", 0, ["training.logical_ranks"]),
    ("training/batch_size", 1e9, ["training.batch_size", "less than or equal to"]),
    ("model", {"target": "no-colon-here"}, ["model.target", "pattern"]),
    ("model", {"target": "pkg.mod:make", "width": 3}, ["model.width", "Extra inputs"]),
    ("model", {"width": 3}, ["model", "name: small_cnn | mlp", "target: package.module:callable"]),
    ("data/target", "pkg.data:make", ["data.path (the built-in digits) and data.target", "exclude each other"]),
    ("data/kwargs", {"n": 1}, ["data.kwargs are the target's arguments"]),
    ("data/workers", -1, ["data.workers"]),
    ("optimizer/kwargs", {"lr": 0.1}, ["training.lr", "remove optimizer.kwargs.lr"]),
    ("optimizer/name", "not a name", ["optimizer.name", "pattern"]),
    ("loss/name", "hinge", ["loss.name", "cross_entropy", "mse"]),
    ("grid", {"training.lr": [0.1, 0.1]}, ["repeats a value"]),
    ("grid", {"training.lr": [0.1, -3]}, ["grid.training.lr[1] = -3", "greater than 0"]),
    ("grid", {"model.heads": [1, 2]}, ["grid.model.heads", "no field 'heads'", "width"]),
    ("grid", {"training.warmup": [5, 10]}, ["grid.training.warmup", "did you mean 'warmup_steps'? valid:", "batch_size"]),
    ("resources/devices", 0, ["resources.devices"]),
    ("resources/devices", 32, ["batch_size (16) is smaller than the 32 devices"]),
    ("resources/devices", [4, 2], ["resources.devices", "min <= max"]),
    ("resources/devices", "many", ["resources.devices", "auto"]),
    ("training/scaling", "fastest", ["training.scaling", "reproducible", "goodput"]),
    ("training/lr_scaling", "log", ["training.lr_scaling", "linear", "sqrt"]),
    ("training/scaling", "goodput", ["training.scaling: goodput", "resources.devices (1) is one size", "range [min, max]"]),
    ("grid", {"training.scaling": ["reproducible", "goodput"]}, ["training.scaling: goodput", "range [min, max]"]),
    ("training/max_batch_size", 64, ["training.max_batch_size", "scaling: reproducible", "use scaling: goodput"]),
    ("training/max_batch_size", 0, ["training.max_batch_size", "greater than or equal to 1"]),
    ("resources/memory_gb", -1, ["resources.memory_gb"]),
    ("tracking/keep_checkpoints", 0, ["tracking.keep_checkpoints"]),
    ("cluster/cpu_slots", 0, ["cluster.cpu_slots"]),
    ("cluster/pool", "Lab A", ["cluster.pool", "pattern"]),
    ("tracking/rank_by", "val_mmd", ["tracking.rank_by: the project's loop reports", "val_accuracy"]),
    ("tracking/rank_mode", "lowest", ["tracking.rank_mode", "'min' or 'max'"]),
]


@pytest.mark.parametrize("change,value,words", BAD, ids=[f"{c}={v if v is not DELETE else 'deleted'}" for c, v, _ in BAD])
def test_bad_spec_names_the_field(change, value, words):
    with pytest.raises(SpecError) as info:
        parse_spec(with_change(change, value))
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in:\n{message}"


def test_a_grid_ranks_by_the_metric_it_names_and_a_search_by_its_objective_alone():
    from tasks.summary import ranked_by

    assert ranked_by(parse_spec(GOOD)) == ("val_accuracy", "max")
    assert ranked_by(parse_spec(with_change("tracking", {"rank_by": "val_loss"}))) == ("val_loss", "min")
    assert ranked_by(parse_spec(with_change("tracking", {"rank_by": "val_loss", "rank_mode": "max"}))) == ("val_loss", "max")
    function = with_change("training/target", "pkg.train:main", with_change("model", DELETE, with_change("grid", {"training.lr": [0.1, 0.2]})))
    assert ranked_by(parse_spec(function)) == ("val_loss", "min")  # a function reports no accuracy of the loop's
    assert ranked_by(parse_spec(with_change("tracking", {"rank_by": "bleu", "rank_mode": "max"}, function))) == ("bleu", "max")
    search = with_change("grid", DELETE, with_change("search", {"trials": 2, "metric": "val_loss", "space": {"training.lr": {"uniform": [0.01, 0.1]}}}))
    assert ranked_by(parse_spec(with_change("tracking", {"rank_by": "val_loss"}, search))) == ("val_loss", "min")
    message = str(pytest.raises(SpecError, parse_spec, with_change("tracking", {"rank_by": "val_accuracy"}, search)).value)
    assert "tracking.rank_by" in message and "search ranks its trials by that objective (val_loss, min)" in message


def test_a_grid_over_the_model_of_a_function_that_builds_its_own_is_named():
    function = with_change("training/target", "pkg.train:main", with_change("model", DELETE))  # GOOD's grid varies model.width
    message = str(pytest.raises(SpecError, parse_spec, function).value)
    assert "grid.model.width: there is no model section to vary" in message and "training.kwargs.<name>" in message


def test_a_field_far_from_every_valid_one_gets_no_guess():
    message = str(pytest.raises(SpecError, parse_spec, with_change("campaign/colour", "red")).value)
    assert "campaign.colour" in message and "did you mean" not in message


def test_every_problem_reported_at_once():
    raw = with_change("training/lr", -1, with_change("model/width", 0))
    message = str(pytest.raises(SpecError, parse_spec, raw).value)
    assert "training.lr" in message and "model.width" in message


def test_not_a_mapping_and_not_yaml(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("- just\n- a list\n")
    assert "must be a mapping" in str(pytest.raises(SpecError, load_spec, bad).value)
    bad.write_text("campaign: {name: [unclosed\n")
    assert "not valid YAML" in str(pytest.raises(SpecError, load_spec, bad).value)
    assert "does not exist" in str(pytest.raises(SpecError, load_spec, tmp_path / "nope.yaml").value)


def test_grid_expands_to_stable_distinct_ids():
    trials = expand_grid(parse_spec(GOOD))
    assert len(trials) == 4
    assert len({t.id for t in trials}) == 4
    assert [t.id for t in trials] == [t.id for t in expand_grid(parse_spec(copy.deepcopy(GOOD)))]
    assert trials[0].label == "lr=0.1 width=4" and trials[0].spec.model.width == 4
    # Anything that changes training changes the id, so a resume never mixes settings.
    longer = expand_grid(parse_spec(with_change("training/steps", 40)))
    assert not {t.id for t in trials} & {t.id for t in longer}


def test_logical_ranks_cover_the_devices():
    elastic = with_change("resources/devices", [1, 4])
    message = str(pytest.raises(SpecError, parse_spec, with_change("training/logical_ranks", 2, elastic)).value)
    assert "training.logical_ranks (2) is smaller than the 4 devices" in message
    # Unset, it is the most devices a trial may use, and part of the trial's identity.
    (trial, *_) = expand_grid(parse_spec(elastic))
    assert trial.spec.training.logical_ranks == 4
    assert trial.id != expand_grid(parse_spec(with_change("training/logical_ranks", 8, elastic)))[0].id


def test_grid_over_kwargs_and_sections_beyond_training():
    raw = with_change("grid", {"optimizer.name": ["SGD", "AdamW"], "model.kwargs.depth": [1, 2]},
                      with_change("model", {"target": "pkg.mod:make", "kwargs": {"depth": 1, "width": 4}}))
    raw = with_change("optimizer", {"name": "SGD", "kwargs": {}}, raw)
    trials = expand_grid(parse_spec(raw))
    assert [(t.spec.optimizer.name, t.spec.model.kwargs["depth"]) for t in trials] == [("SGD", 1), ("SGD", 2), ("AdamW", 1), ("AdamW", 2)]
    assert all(t.spec.model.kwargs["width"] == 4 for t in trials)  # the rest of kwargs is kept
    assert len({t.id for t in trials}) == 4


def test_loader_settings_do_not_change_trial_ids():
    base = expand_grid(parse_spec(GOOD))
    faster = expand_grid(parse_spec(with_change("data/workers", 4, with_change("data/on_device", False))))
    assert [t.id for t in base] == [t.id for t in faster]


def test_empty_grid_is_one_trial():
    trials = expand_grid(parse_spec(with_change("grid", {})))
    assert len(trials) == 1 and trials[0].label == "default"


@pytest.mark.parametrize("change,value,words", [
    ("training/lr", 0, ["training.lr"]),
    ("resources/devices", 16, ["needs 16", "devices"]),
    ("data/path", "missing/digits.npz", ["data.path", "dvc repro prepare"]),
])
def test_cli_rejects_before_anything_runs(tmp_path, digits_npz, change, value, words):
    from conftest import campaign_cli

    raw = with_change("data/path", str(digits_npz))
    raw = with_change("cluster/cpu_slots", 2, raw)
    raw = with_change(change, value, raw)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    result = campaign_cli("launch", "params.yaml", cwd=tmp_path)
    output = " ".join((result.stdout + result.stderr).split())  # rich wraps long lines
    assert result.returncode == 2, output
    for word in words:
        assert word in output, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]  # nothing half-written


def test_goodput_trials_carry_their_scaling_into_the_trainer(tmp_path):
    from flows.run.campaign import trial_config
    from cluster.sizing import SizedRequest

    raw = with_change("training/lr_scaling", "sqrt", with_change("training/scaling", "goodput", with_change("resources/devices", [1, 4])))
    (trial, *_) = expand_grid(parse_spec(raw))
    cfg = trial_config(parse_spec(raw), trial, tmp_path, None, SizedRequest(trial.id, 1, 4, (0, 0, 0, 0)))
    assert (cfg.scaling, cfg.lr_scaling, cfg.logical_ranks) == ("goodput", "sqrt", 4)
    assert cfg.batch_at(2) == GOOD["training"]["batch_size"] // 2
    reproducible = expand_grid(parse_spec(with_change("resources/devices", [1, 4])))[0]
    assert reproducible.id != trial.id  # another way to train: another trial


def test_launch_pool_option_is_checked_as_if_written_in_the_spec(tmp_path):
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump(with_change("resources/devices", [1, 4])))
    assert load_spec(params, pool="lab").cluster.pool == "lab" and load_spec(params).cluster.pool is None
    assert "cluster.pool" in str(pytest.raises(SpecError, load_spec, params, pool="Lab A").value)


def test_each_campaign_writes_its_own_summary_unless_the_spec_names_one():
    """An example's campaign must not overwrite the file the default campaign's DVC stage tracks."""
    raw = with_change("tracking", {})
    assert parse_spec(raw).tracking.summary == Path(f"metrics/{raw['campaign']['name']}.json")
    assert parse_spec(with_change("tracking/summary", "out/s.json")).tracking.summary == Path("out/s.json")
    assert parse_spec(with_change("campaign/name", "other", with_change("tracking", {}))).tracking.summary == Path("metrics/other.json")


def test_a_pool_without_shared_storage_says_what_it_needs_before_anything_runs(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    needs = {"cluster": {"pool": "lab", "shared_storage": False},
             "tracking": {"dvc_remote": "/srv/checkpoints", "mlflow_uri": "http://head:5000"},
             "training": {**GOOD["training"], "eval_every": 10}}
    assert parse_spec({**GOOD, **needs}).cluster.shared_storage is False
    for change, value, words in [
        ("cluster/pool", DELETE, ["shared_storage: false", "cluster.pool"]),
        ("tracking/dvc_remote", DELETE, ["tracking.dvc_remote", "checkpoints travel"]),
        ("tracking/mlflow_uri", "sqlite:///mlflow.db", ["MLflow server", "sqlite:///mlflow.db", "mlflow server --host"]),
        ("early_stopping", {"rule": "asha"}, ["early_stopping", "drop early_stopping"]),
    ]:
        message = str(pytest.raises(SpecError, parse_spec, with_change(change, value, {**GOOD, **needs})).value)
        assert all(word in message for word in words), (change, message)
