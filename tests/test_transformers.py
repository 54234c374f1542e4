"""Hugging Face transformers models as model.target: the part of a model's output the loss
takes (model.output: training/outputs.py), a model built from its config (training/hf.py),
and the example (examples/transformers/) through the real `campaign launch`, killed and resumed."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from conftest import REPO, campaign_cli, wait_for
from training.errors import CampaignError
from training.outputs import ModelOutputError, Objective, pick
from training.workload import build_model, build_objective, check_workload

transformers = pytest.importorskip("transformers")
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions  # noqa: E402

EXAMPLE = REPO / "examples" / "transformers" / "params.yaml"
TINY_CONFIG = {"vocab_size": 256, "n_positions": 16, "n_layer": 1, "n_embd": 16, "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}
GPT2 = {"target": "training.hf:from_config", "kwargs": {"model": "GPT2LMHeadModel", "config": TINY_CONFIG}}
BYTES = {"target": "examples.transformers.text:byte_windows", "kwargs": {"block": 16, "chars": 4000}}
CE, ADAMW = {"name": "cross_entropy"}, {"name": "AdamW", "kwargs": {}}


# --- which part of the output the loss takes ------------------------------------------------------

def test_auto_takes_a_tensor_as_it_is_and_a_tuples_first_element():
    logits = torch.randn(2, 3)
    assert pick(logits) is logits
    assert pick((logits, torch.zeros(1))) is logits
    assert pick([logits]) is logits
    Out = namedtuple("Out", "scores extra")
    assert pick(Out(logits, 1), "scores") is logits


def test_auto_takes_a_model_outputs_logits_even_where_the_loss_comes_first():
    logits, loss = torch.randn(2, 4, 8), torch.tensor(1.5)
    out = CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)
    assert out[0] is loss  # a ModelOutput's first element is its loss: "the first element" would train on the loss
    assert pick(out) is logits and pick(out, "logits") is logits
    assert pick({"logits": logits, "hidden": torch.zeros(1)}) is logits


def test_output_loss_calls_the_model_with_labels_and_trains_on_its_loss():
    seen = {}

    class OwnLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x, labels=None):
            seen["labels"] = labels
            return {"loss": (self.w * x).mean(), "logits": x}

    x, y = torch.ones(2, 3), torch.zeros(2, dtype=torch.long)
    objective = Objective(None, "loss")
    assert objective(OwnLoss(), x, y).item() == pytest.approx(1.0)
    assert seen["labels"] is y
    assert objective.predictions(objective.forward(OwnLoss(), x, y)) is None  # no accuracy on a model's own shifted labels


@pytest.mark.parametrize("raw, output, says", [
    (CausalLMOutputWithCrossAttentions(logits=torch.zeros(1)), "scores", "without 'scores' (its parts: logits)"),
    (CausalLMOutputWithCrossAttentions(logits=torch.zeros(1)), "hidden_states", "'hidden_states' of the model's output "
     "(a CausalLMOutputWithCrossAttentions) is None, the model did not compute it"),
    ({"scores": torch.zeros(1)}, "auto", "auto takes the `logits` of a dict output"),
    (torch.zeros(1), "logits", "returned a tensor: leave model.output out (auto)"),
    (("text", torch.zeros(1)), "auto", "the first element of the model's output (a tuple) is a str, not a tensor"),
    ("text", "auto", "the model returned a str"),
])
def test_an_unusable_output_names_model_output_and_what_the_model_returned(raw, output, says):
    with pytest.raises(ModelOutputError) as caught:
        pick(raw, output)
    assert str(caught.value).startswith("model.output: ") and says in str(caught.value)


def test_output_loss_on_a_model_that_computes_none_says_how_to_fix_it():
    with pytest.raises(ModelOutputError, match=r"model.output: loss takes the loss the model computes .* has none .* leave model.output out"):
        Objective(None, "loss").loss(CausalLMOutputWithCrossAttentions(logits=torch.zeros(1)), torch.zeros(1))


# --- the check before a campaign, sizing, profiling ------------------------------------------------

def test_a_transformers_model_passes_the_check_with_its_logits_under_cross_entropy(monkeypatch):
    monkeypatch.chdir(REPO)
    found = check_workload(model=GPT2, data=BYTES, loss=CE, optimizer=ADAMW, lr=1e-3)
    assert found.input_shape == (16,) and found.output_shape == (16, 256)


def test_the_check_names_model_output_for_a_part_the_output_lacks(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(CampaignError, match=r"^model.output: .* without 'scores' \(its parts: logits\): set model.output"):
        check_workload(model={**GPT2, "output": "scores"}, data=BYTES, loss=CE, optimizer=ADAMW, lr=1e-3)


def test_the_models_own_loss_trains_on_targets_equal_to_the_inputs(monkeypatch):
    """output: loss: GPT-2 shifts its labels itself, so the data gives each window as its own target."""
    monkeypatch.chdir(REPO)
    data = {**BYTES, "kwargs": {**BYTES["kwargs"], "shift": False}}
    found = check_workload(model={**GPT2, "output": "loss"}, data=data, loss=CE, optimizer=ADAMW, lr=1e-3)
    assert found.output_shape == ()  # no predictions compared with the targets
    x = torch.randint(0, 256, (2, 16))
    torch.manual_seed(0)
    model = build_model(GPT2).eval()  # no dropout: the two forward passes compare
    own = build_objective({**GPT2, "output": "loss"}, CE)(model, x, x)
    ours = F.cross_entropy(model(x).logits[:, :-1].reshape(-1, 256), x[:, 1:].reshape(-1))
    assert own.item() == pytest.approx(ours.item(), rel=1e-5)


def test_sizing_and_the_profiler_run_the_model_through_model_output():
    from cluster.sizing import measure_memory
    from training.profiler import profile_model

    torch.manual_seed(0)
    model, x = build_model(GPT2), torch.randint(0, 256, (4, 16))
    objective = build_objective(GPT2, CE)
    estimate = measure_memory(model, x, x, objective, 2, on_gpu=False, eval_input=x, eval_target=x)
    assert estimate.activations_bytes > 0 and estimate.eval_bytes > 0
    own = measure_memory(model, x, x, build_objective({**GPT2, "output": "loss"}, CE), 2, on_gpu=False, eval_input=x, eval_target=x)
    assert own.activations_bytes > 0
    profile = profile_model(model, (x, x), objective, torch.device("cpu"), repeats=1)
    assert profile.parameter_count == sum(p.numel() for p in model.parameters())
    assert sum(l.forward_flops for l in profile.layers) > 0  # the flop counter saw the model's layers


# --- a model from its config ----------------------------------------------------------------------

def test_from_config_builds_the_class_or_an_auto_class_without_download():
    from training.hf import from_config

    assert type(from_config("GPT2LMHeadModel", TINY_CONFIG)).__name__ == "GPT2LMHeadModel"
    auto = from_config("AutoModelForCausalLM", {"model_type": "gpt2", **TINY_CONFIG})
    assert type(auto).__name__ == "GPT2LMHeadModel" and auto.config.n_layer == 1 and auto.config.use_cache is False


@pytest.mark.parametrize("model, config, says", [
    ("GPT2LMHeadModle", {}, "model.kwargs.model: transformers has no model class 'GPT2LMHeadModle' (did you mean GPT2LMHeadModel"),
    ("GPT2LMHeadModel", {"n_layers": 2}, "model.kwargs.config: GPT2Config has no n_layers (n_layers: did you mean n_layer?)"),
    ("AutoModelForCausalLM", {}, "model.kwargs.config.model_type: AutoModelForCausalLM builds"),
    ("GPT2LMHeadModel", {"n_embd": 30, "n_head": 4}, "model.kwargs.config: GPT2LMHeadModel from GPT2Config({'n_embd': 30, 'n_head': 4}) raised"),
])
def test_from_config_refuses_a_wrong_class_or_key_naming_the_field(model, config, says):
    from training.hf import from_config

    with pytest.raises(CampaignError) as caught:
        from_config(model, config)
    assert says in str(caught.value)


# --- the spec -------------------------------------------------------------------------------------

def test_model_output_at_its_default_keeps_the_trial_ids_and_loss_with_a_loss_section_is_refused():
    from tasks.grid import expand_grid
    from training.spec import SpecError, parse_spec

    base = {"campaign": {"name": "hf"}, "data": BYTES, "model": GPT2, "training": {"steps": 10, "batch_size": 4, "lr": 0.01}}
    plain, auto = (expand_grid(parse_spec(raw))[0] for raw in (base, {**base, "model": {**GPT2, "output": "auto"}}))
    assert plain.id == auto.id and "output" not in plain.spec.model.model_dump()
    own = expand_grid(parse_spec({**base, "model": {**GPT2, "output": "loss"}}))[0]
    assert own.id != plain.id and own.spec.model.model_dump()["output"] == "loss"
    with pytest.raises(SpecError, match=r"loss.name: model.output: loss trains on the loss the model computes itself"):
        parse_spec({**base, "model": {**GPT2, "output": "loss"}, "loss": CE})
    with pytest.raises(SpecError, match=r"model.output"):
        parse_spec({**base, "model": {**GPT2, "output": "not a name"}})


# --- the example through `campaign launch` ---------------------------------------------------------

STEPS, LOG_EVERY, CHECKPOINT_EVERY, HELD_AT = 40, 5, 10, 25


def write_example(folder: Path, steps: int = STEPS, grid: list[int] | None = None, devices: int = 1) -> Path:
    """The example's params.yaml at a tiny size, with its runs, MLflow and summary in `folder`."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["data"]["kwargs"] = {"block": 16, "chars": 40_000}
    spec["model"]["kwargs"]["config"].update(n_positions=16, n_embd=16, n_head=2)
    spec["training"].update(steps=steps, batch_size=8, warmup_steps=2, log_every=LOG_EVERY, checkpoint_every=CHECKPOINT_EVERY,
                            eval_every=20)
    spec["grid"] = {"model.kwargs.config.n_layer": grid} if grid else {}
    spec["resources"] = {"devices": devices}
    spec["cluster"] = {"cpu_slots": devices}
    spec["tracking"] = {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"), "summary": str(folder / "s.json")}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(EXAMPLE.read_text().splitlines()[0] + "\n" + yaml.safe_dump(spec, sort_keys=False))
    return folder / "runs" / spec["campaign"]["name"]


def trial_runs(folder: Path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.`campaign.kind` = 'trial'")
    return client, runs


def test_the_example_spec_is_valid_and_its_first_line_points_at_the_schema():
    from tasks.grid import expand_grid
    from training.spec import load_spec

    assert EXAMPLE.read_text().startswith("# yaml-language-server: $schema=../../schema/params.schema.json\n")
    trials = expand_grid(load_spec(EXAMPLE))
    assert [t.spec.model.kwargs["config"]["n_layer"] for t in trials] == [1, 2]


@pytest.mark.slow
def test_the_example_trains_through_campaign_launch(tmp_path):
    root = write_example(tmp_path, steps=20, grid=[1, 2])
    done = campaign_cli("launch", "params.yaml", "--no-live", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(root.glob("*/result.json"))]
    assert len(results) == 2 and all(r["steps"] == 20 for r in results)
    for r in results:  # token accuracy: the logits' last axis lines up with the byte targets
        assert math.isfinite(r["metrics"]["val_loss"]) and 0.0 <= r["metrics"]["val_accuracy"] <= 1.0
    client, runs = trial_runs(tmp_path)
    assert len(runs) == 2
    for run in runs:
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] != []


def campaign_processes(folder: Path) -> list[int]:
    """Processes running in the campaign's folder: the campaign, its hub, its trial's workers."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(proc / "cwd") == str(folder):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_a_sigkilled_example_resumes_and_mlflow_holds_each_training_loss_step_once(tmp_path):
    """A 2-process DDP trial (torchrun: the ModelOutput through DistributedDataParallel); the
    campaign's process group SIGKILLed while the trial is held at step 25 (checkpoints every 10
    steps); `campaign resume` goes on from the last checkpoint to the end, and MLflow holds
    every logged step of train_loss exactly once, the replayed ones too."""
    from training.files import read_json
    from training.layout import trial_files
    from training.manifest import list_checkpoints

    root = write_example(tmp_path, devices=2)
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"], cwd=tmp_path,
                            stdout=open(tmp_path / "out.log", "a"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "CAMPAIGN_HOLD_AT_STEP": str(HELD_AT)})
    try:
        trial = wait_for(lambda: next((p for p in root.glob("*") if trial_files(p).config.exists()), None) or proc.poll() is not None,
                         300, "the trial's folder")
        assert isinstance(trial, Path), (tmp_path / "out.log").read_text()[-3000:]
        trial_files(trial).hold.touch()
        wait_for(lambda: (read_json(trial_files(trial).progress) or {}).get("state") == "held" or proc.poll() is not None,
                 300, f"the trial held at step {HELD_AT}")
        assert proc.poll() is None, (tmp_path / "out.log").read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the campaign, its hub, its trial's launcher: all at once
        proc.wait()
    wait_for(lambda: not campaign_processes(tmp_path), 60, "the killed campaign's processes to end")
    assert not trial_files(trial).result.exists()
    saved = [int(p.name.split("-")[1]) for p in list_checkpoints(trial_files(trial).checkpoints)]
    assert saved and max(saved) < HELD_AT

    trial_files(trial).hold.unlink()
    done = campaign_cli("resume", "params.yaml", "--no-live", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(trial_files(trial).result.read_text())
    assert result["steps"] == STEPS and 0 < result["resumed_from_step"] < HELD_AT
    client, (run,) = trial_runs(tmp_path)
    assert run.data.tags.get("campaign.state") == "finished"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert sorted(steps) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))  # each once, the replayed ones too
