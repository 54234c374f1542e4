"""Every number of the spec is bounded to what a run can honour, checked before anything runs.

For each numeric field (and each grid value, search range end and optimizer keyword that
reaches one): a value at its bound is accepted, one just past it is refused with the field's
path and its valid range, as `campaign plan` and `launch` read the spec (exit 2). A CPU-slot
count past the bound answers at once, and one at the bound plans in seconds (it used to hang:
the inventory compared every pair of slots).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time

import pytest
import yaml

from training.spec import (MAX_BATCH, MAX_DEVICES, MAX_NODES, MAX_SEED, MAX_SLOTS, MAX_STEPS, MAX_TIMEOUT_S, SpecError,
                           load_spec)

BASE = {
    "campaign": {"name": "bounds", "seed": 0},
    "model": {"name": "small_cnn", "width": 8},
    "training": {"steps": 20, "batch_size": 16, "lr": 0.1},
}
SEARCH = {"strategy": "random", "trials": 4, "space": {"training.lr": {"log_uniform": [0.01, 1.0]}}}
GOODPUT = {"training": {"scaling": "goodput"}, "resources": {"devices": [1, 2]}}
STOPPING = {"early_stopping": {"rule": "asha"}, "training": {"eval_every": 10}}  # early stopping needs evaluations
WIDE = {"training": {"batch_size": MAX_DEVICES}}  # every logical rank (device) needs a sample of each step


def node(i: int, **fields) -> dict:
    return {"name": f"n{i}", "devices": 2, "memory_gb": 16, **fields}


# (what, path, value at the bound, value just past it, words the refusal must hold, base changes)
CASES = [
    ("seed", "campaign.seed", MAX_SEED, MAX_SEED + 1, ["campaign.seed", f"[0, {MAX_SEED}]"], {}),
    ("seed-low", "campaign.seed", 0, -1, ["campaign.seed", f"[0, {MAX_SEED}]"], {}),
    ("seed+seeds", "campaign.seed", MAX_SEED - 99, MAX_SEED - 98, ["campaign.seed", "search.seeds", f"[0, {MAX_SEED - 99}]"],
     {"search": {**SEARCH, "seeds": 100}}),
    ("data.workers", "data.workers", 64, 65, ["data.workers", "[0, 64]"], {}),
    ("cnn.width", "model.width", 1024, 1025, ["model.width", "[1, 1024]"], {}),
    ("cnn.dropout", "model.dropout", 0.999, 1.0, ["model.dropout", "[0, 1)"], {}),
    ("dropout-nan", "model.dropout", 0.0, float("nan"), ["model.dropout", "finite"], {}),
    ("mlp.width", "model.width", 65536, 65537, ["model.width", "[1, 65536]"], {"model": {"name": "mlp", "depth": 1}}),
    ("mlp.depth", "model.depth", 64, 65, ["model.depth", "[1, 64]"], {"model": {"name": "mlp", "width": 8}}),
    ("mlp.weights", "model.width", 32000, 32768, ["model.width (32768)", "model.depth (2)", "1,073,741,824"],
     {"model": {"name": "mlp", "depth": 2}}),
    ("steps", "training.steps", MAX_STEPS, MAX_STEPS + 1, ["training.steps", f"[1, {MAX_STEPS}]"], {}),
    ("batch_size", "training.batch_size", MAX_BATCH, MAX_BATCH + 1, ["training.batch_size", f"[1, {MAX_BATCH}]"], {}),
    ("lr", "training.lr", 10.0, 10.001, ["training.lr", "(0, 10]"], {}),
    ("lr-zero", "training.lr", 1e-12, 0.0, ["training.lr", "(0, 10]"], {}),
    ("lr-nan", "training.lr", 0.1, float("nan"), ["training.lr", "finite"], {}),
    ("warmup_steps", "training.warmup_steps", 19, 20, ["warmup_steps (20) must be smaller than steps (20)"], {}),
    ("grad_clip_norm", "training.grad_clip_norm", 1e6, 1.0001e6, ["training.grad_clip_norm", "(0, 1000000]"], {}),
    ("grad_clip_norm-inf", "training.grad_clip_norm", 1.0, float("inf"), ["training.grad_clip_norm", "finite"], {}),
    ("logical_ranks", "training.logical_ranks", MAX_DEVICES, MAX_DEVICES + 1, ["training.logical_ranks", f"[1, {MAX_DEVICES}]"], WIDE),
    ("max_batch_size", "training.max_batch_size", MAX_BATCH, MAX_BATCH + 1, ["training.max_batch_size", f"[1, {MAX_BATCH}]"], GOODPUT),
    ("max_device_batch", "training.max_device_batch", MAX_BATCH, MAX_BATCH + 1, ["training.max_device_batch", f"[1, {MAX_BATCH}]"], {}),
    ("checkpoint_every", "training.checkpoint_every", MAX_STEPS, MAX_STEPS + 1, ["training.checkpoint_every", f"[1, {MAX_STEPS}]"], {}),
    ("log_every", "training.log_every", MAX_STEPS, MAX_STEPS + 1, ["training.log_every", f"[1, {MAX_STEPS}]"], {}),
    ("eval_every", "training.eval_every", MAX_STEPS, MAX_STEPS + 1, ["training.eval_every", f"[1, {MAX_STEPS}]"], {}),
    ("stall_timeout_s", "training.stall_timeout_s", MAX_TIMEOUT_S, MAX_TIMEOUT_S + 1, ["training.stall_timeout_s", "(0, 604800]"], {}),
    ("stall_timeout_s-inf", "training.stall_timeout_s", 300, float("inf"), ["training.stall_timeout_s", "(0, 604800]"], {}),
    ("momentum", "optimizer.kwargs.momentum", 0.999, 1.0, ["optimizer.kwargs.momentum", "[0, 1)"], {}),
    ("weight_decay", "optimizer.kwargs.weight_decay", 1.0, 1.01, ["optimizer.kwargs.weight_decay", "[0, 1]"], {}),
    ("dampening", "optimizer.kwargs.dampening", 1.0, 1.1, ["optimizer.kwargs.dampening", "[0, 1]"], {}),
    ("betas", "optimizer.kwargs.betas", [0.9, 0.999], [0.9, 1.0], ["optimizer.kwargs.betas", "each in [0, 1)"],
     {"optimizer": {"name": "AdamW"}}),
    ("eps", "optimizer.kwargs.eps", 1.0, 0.0, ["optimizer.kwargs.eps", "(0, 1]"], {"optimizer": {"name": "AdamW"}}),
    ("optimizer-nan", "optimizer.kwargs.lr_decay", 0.1, float("nan"), ["optimizer.kwargs.lr_decay", "finite"],
     {"optimizer": {"name": "Adagrad"}}),
    ("devices", "resources.devices", MAX_DEVICES, MAX_DEVICES + 1, ["resources.devices", f"[1, {MAX_DEVICES}]"], WIDE),
    ("devices-range", "resources.devices", [1, MAX_DEVICES], [1, MAX_DEVICES + 1], ["resources.devices", f"[1, {MAX_DEVICES}]"], WIDE),
    ("memory_gb", "resources.memory_gb", 1024, 1024.5, ["resources.memory_gb", "(0, 1024]"], {}),
    ("memory_gb-inf", "resources.memory_gb", 1.0, float("inf"), ["resources.memory_gb", "(0, 1024]"], {}),
    ("cpu_slots", "cluster.cpu_slots", MAX_SLOTS, MAX_SLOTS + 1, ["cluster.cpu_slots", f"[1, {MAX_SLOTS}]"], {}),
    ("nodes", "cluster.nodes", [node(i) for i in range(MAX_NODES)], [node(i) for i in range(MAX_NODES + 1)],
     ["cluster.nodes", f"at most {MAX_NODES}"], {}),
    ("node.devices", "cluster.nodes", [node(0, devices=MAX_SLOTS)], [node(0, devices=MAX_SLOTS + 1)],
     ["cluster.nodes.0.devices", f"[1, {MAX_SLOTS}]"], {}),
    ("node.memory_gb", "cluster.nodes", [node(0, memory_gb=1024)], [node(0, memory_gb=1025)],
     ["cluster.nodes.0.memory_gb", "(0, 1024]"], {}),
    ("node.nvlink", "cluster.nodes", [node(0, nvlink_pairs=[[0, 1]])], [node(0, nvlink_pairs=[[0, 2]])],
     ["cluster node 'n0'", "nvlink pair [0, 2]", "[0, 1]"], {}),
    ("resize_pause_s", "scheduling.resize_pause_s", 3600, 3600.5, ["scheduling.resize_pause_s", "(0, 3600]"], {}),
    ("min_run_s", "scheduling.min_run_s", 86400, 86401, ["scheduling.min_run_s", "(0, 86400]"], {}),
    ("search.trials", "search.trials", 100_000, 100_001, ["search.trials", "[1, 100000]"], {"search": SEARCH}),
    ("search.seeds", "search.seeds", 100, 101, ["search.seeds", "[1, 100]"], {"search": SEARCH}),
    ("search.uniform", "search.space", {"training.lr": {"uniform": [0.1, 10.0]}}, {"training.lr": {"uniform": [0.1, 10.5]}},
     ["search.space.training.lr[1] = 10.5", "(0, 10]"], {"search": SEARCH}),
    ("search.int_uniform", "search.space", {"training.steps": {"int_uniform": [10, MAX_STEPS]}},
     {"training.steps": {"int_uniform": [10, MAX_STEPS + 1]}}, [f"search.space.training.steps[1] = {MAX_STEPS + 1}", f"[1, {MAX_STEPS}]"],
     {"search": SEARCH}),
    ("grid.steps", "grid", {"training.steps": [20, MAX_STEPS]}, {"training.steps": [20, MAX_STEPS + 1]},
     [f"grid.training.steps[1] = {MAX_STEPS + 1}", f"[1, {MAX_STEPS}]"], {}),
    ("grid.momentum", "grid", {"optimizer.kwargs.momentum": [0.5, 0.999]}, {"optimizer.kwargs.momentum": [0.5, 1.5]},
     ["grid.optimizer.kwargs.momentum[1] = 1.5", "[0, 1)"], {}),
    ("min_steps", "early_stopping.min_steps", 20, 21, ["early_stopping.min_steps (21)", "[1, 20]"], STOPPING),
    ("reduction_factor", "early_stopping.reduction_factor", 100, 101, ["early_stopping.reduction_factor", "[2, 100]"], STOPPING),
    ("keep_checkpoints", "tracking.keep_checkpoints", 1000, 1001, ["tracking.keep_checkpoints", "[1, 1000]"], {}),
    ("system_metrics_every_s", "tracking.system_metrics_every_s", 3600, 3600.5, ["tracking.system_metrics_every_s", "[0, 3600]"], {}),
    ("system_metrics_every_s-low", "tracking.system_metrics_every_s", 0.1, 0.05, ["tracking.system_metrics_every_s", "[0.1, 3600]"], {}),
]


def merged(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for section, fields in changes.items():
        out[section] = {**out.get(section, {}), **fields} if isinstance(fields, dict) and section != "search" else copy.deepcopy(fields)
    return out


def spec_with(path: str, value, changes: dict) -> dict:
    raw = merged(BASE, changes)
    *parents, last = path.split(".")
    node_ = raw
    for part in parents:
        node_ = node_.setdefault(part, {})
    node_[last] = copy.deepcopy(value)
    return raw


def written(tmp_path, raw: dict):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("what,path,at,past,words,changes", CASES, ids=[c[0] for c in CASES])
def test_a_value_past_its_bound_is_refused_naming_the_field_and_range(tmp_path, what, path, at, past, words, changes):
    load_spec(written(tmp_path, spec_with(path, at, changes)))  # at the bound: accepted
    with pytest.raises(SpecError) as refused:
        load_spec(written(tmp_path, spec_with(path, past, changes)))
    message = " ".join(str(refused.value).split())
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


def test_the_largest_seeds_run_where_the_campaign_uses_them():
    """At the bound, every consumer of a trial's seed takes it: torch, numpy's legacy seeding
    (users' code), the data order, and the search's samplers (their offset wraps at 2**32)."""
    import numpy as np
    import torch

    from tasks.grid import make_trial
    from training.data import SampleOrder
    from training.spec import parse_spec

    spec = parse_spec(merged(BASE, {"campaign": {"seed": MAX_SEED - 99}, "search": {**SEARCH, "seeds": 100}}))
    seed = make_trial(spec, {"training.lr": 0.1}, seed_index=99).spec.seed
    assert seed == MAX_SEED
    torch.manual_seed(seed)
    np.random.seed(seed)
    assert len(SampleOrder(10, seed).permutation(0)) == 10
    assert len(SampleOrder(1000, seed).global_batch(MAX_STEPS, 64)) == 64  # the last step's positions: an epoch past 6e7


def test_the_search_samplers_take_the_largest_seed(tmp_path):
    from tasks.search import Search
    from training.spec import parse_spec

    for strategy in ("random", "tpe", "sobol"):
        raw = merged(BASE, {"campaign": {"name": f"s-{strategy}", "seed": MAX_SEED}, "search": {**SEARCH, "strategy": strategy}})
        search = Search(parse_spec(raw), tmp_path / strategy)
        assert search.ask() is not None  # drawn: the sampler's RandomState took its seed


def test_cpu_slots_at_the_bound_make_an_inventory_at_once():
    from cluster.inventory import InventoryError, discover

    started = time.process_time()
    assert len(discover(cpu_slots=MAX_SLOTS).devices) == MAX_SLOTS
    assert time.process_time() - started < 2.0
    # `campaign cluster --cpu-slots` and `campaign worker --cpu-slots` do not go through the spec.
    with pytest.raises(InventoryError, match=f"at most {MAX_SLOTS} CPU slots"):
        discover(cpu_slots=MAX_SLOTS + 1)


def plan(tmp_path, raw: dict, timeout: float) -> subprocess.CompletedProcess:
    written(tmp_path, raw)
    return subprocess.run([sys.executable, "-m", "flows.cli", "plan", "params.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout, env={**__import__("os").environ, "COLUMNS": "200"})


def test_campaign_plan_refuses_cpu_slots_past_the_bound_and_plans_at_it(tmp_path, digits_npz):
    raw = merged(BASE, {"data": {"path": str(digits_npz)}, "cluster": {"cpu_slots": MAX_SLOTS + 1}})
    refused = plan(tmp_path, raw, timeout=120)  # it used to hang here
    output = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "cluster.cpu_slots" in output and f"[1, {MAX_SLOTS}]" in output, output
    raw["cluster"]["cpu_slots"] = MAX_SLOTS
    planned = plan(tmp_path, raw, timeout=240)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert f"{MAX_SLOTS} cpu device(s)" in " ".join(planned.stdout.split())


def test_campaign_plan_refuses_a_seed_past_the_bound(tmp_path, digits_npz):
    refused = plan(tmp_path, merged(BASE, {"data": {"path": str(digits_npz)}, "campaign": {"seed": 2**64}}), timeout=120)
    output = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "campaign.seed" in output and f"[0, {MAX_SEED}]" in output, output
