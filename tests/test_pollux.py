"""Goodput with the batch chosen (cluster.goodput) and the Pollux baseline (cluster.pollux)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.goodput import GoodputView, NoiseGrowth, best_scale, gain, rate
from cluster.jobs import Cluster, Job, devices_of, validate_allocation
from cluster.pollux import MAX_JOB_NODES, PolluxPolicy, _Problem
from cluster.simulator import SimConfig, simulate
from cluster.throughput import AnalyticStepTime, OnlineStepTime
from cluster.policy import ElasticPolicy
from cluster.workloads import NOISE_SCALES, NOISE_WORKLOAD, SCALING, WorkloadError, WorkloadJob, noise_growth
from tests.test_policy import scenarios

MODEL = AnalyticStepTime(fixed=0.02, compute=0.5, intra=0.01, inter=0.05, per_node=0.002)


# ---------------------------------------------------------------- goodput


@given(noise=st.floats(0.01, 100.0), fixed=st.floats(0.001, 1.0), per_scale=st.floats(0.001, 1.0))
def test_the_closed_form_batch_is_the_best_on_a_fine_grid(noise, fixed, per_scale):
    best = best_scale(fixed, per_scale, noise, 32.0)
    grid = np.geomspace(1.0, 32.0, 2000)
    rates = [gain(s, noise) / (fixed + per_scale * s) for s in grid]
    assert gain(best, noise) / (fixed + per_scale * best) >= max(rates) * (1 - 1e-6)


def test_the_batch_grows_with_the_noise_scale_and_stays_in_bounds():
    scales = [rate(MODEL, 4, 1, noise)[1] for noise in (0.0, 0.1, 1.0, 10.0, 100.0, 1e6)]
    assert scales == sorted(scales) and scales[0] == 1.0 and scales[-1] == 32.0
    assert scales[2] < scales[3] < scales[4]  # it moves where the noise scale is informative


def test_a_goodput_view_never_predicts_less_progress_than_the_fixed_batch():
    online = OnlineStepTime(MODEL, 16, 4)
    for noise in (0.0, 0.5, 5.0):
        view = GoodputView(online, noise)
        for n, k in ((1, 1), (4, 1), (8, 2), (16, 4)):
            assert view.step_time(n, k) <= online.step_time(n, k) * (1 + 1e-9)
    # No gradient noise: a larger batch buys nothing, the view is the model itself.
    assert GoodputView(online, 0.0).step_time(8, 2) == pytest.approx(online.step_time(8, 2))


def test_noise_grows_geometrically_through_training_and_the_measured_values_are_read():
    growth = NoiseGrowth(0.5, 8.0)
    assert growth.at(0.0) == 0.5 and growth.at(1.0) == pytest.approx(8.0) and growth.at(0.5) == pytest.approx(2.0)
    measured = noise_growth("small", "measured")  # cluster/noise_scales.json, written by bench/noise_scale.py
    assert 0 < measured.start and 0 < measured.end


def test_the_published_noise_scales_load_with_their_source_for_every_size_class():
    rows = json.loads(NOISE_SCALES["published"].read_text())
    for scaling in SCALING:
        name = NOISE_WORKLOAD["published"][scaling]
        assert "petuum/adaptdl" in rows[name]["source"]  # a figure without its source is not one to bench on
        published, measured = noise_growth(scaling, "published"), noise_growth(scaling, "measured")
        # Real models' noise scale grows far past their batch through training; the tiny CPU
        # workloads' barely does, which is what made a fixed batch look cheap.
        assert published.end / published.start > 10 and published.end > 30
        assert published.end > measured.end
    with pytest.raises(WorkloadError, match="unknown noise model"):
        noise_growth("small", "guessed")


def test_a_fixed_batch_costs_more_under_the_published_noise_scales_than_the_measured_ones():
    """A lone job of each size class, its batch fixed against chosen for goodput: the price
    of the fixed batch, its JCT over the goodput one's, is what the bench's reproducible mode
    pays; under the trainer's tiny workloads it is nil, under real models' it is not."""
    cluster = Cluster.uniform(2, 4)
    prices = {}
    for scaling in SCALING:
        job = WorkloadJob("j", 0.0, 2 * 3600.0, 4, 1, 8, scaling)
        fixed = simulate(cluster, [job], ElasticPolicy(), SimConfig(), seed=1).jobs[0].completion_time
        for model in NOISE_SCALES:
            adaptive = replace(job, goodput=True, noise_model=model)
            prices[scaling, model] = fixed / simulate(cluster, [adaptive], ElasticPolicy(), SimConfig(), seed=1).jobs[0].completion_time
    for scaling in SCALING:
        assert prices[scaling, "measured"] < 1.02
        assert prices[scaling, "published"] > prices[scaling, "measured"] + 0.05
    assert sum(prices[s, "published"] for s in SCALING) / len(SCALING) > 1.15


def test_a_goodput_job_in_the_simulator_takes_larger_batches_as_its_noise_scale_grows():
    cluster = Cluster.uniform(1, 4)
    job = WorkloadJob("g", 0.0, 3600.0, 4, 1, 4, "small", goodput=True)
    early, late = job.noise.at(0.0), job.noise.at(1.0)
    assert late > early
    assert rate(job.true_model, 4, 1, late)[1] >= rate(job.true_model, 4, 1, early)[1]
    result = simulate(cluster, [job], PolluxPolicy(), SimConfig())
    assert result.jobs[0].finish > 0


# ---------------------------------------------------------------- Pollux


def _job(job_id: str, **kw) -> Job:
    return Job(job_id, kw.pop("arrival", 0.0), kw.pop("requested", 1), kw.pop("min_devices", 1), kw.pop("max_devices", 16),
               kw.pop("model", GoodputView(OnlineStepTime(MODEL, 16, 4), 2.0)), **kw)


def test_pollux_grows_a_lone_job_by_doubling_where_it_has_run_until_its_max():
    """The paper's behaviour on an idle cluster: a job starts on one device and grows, at
    most twice what it has run on at each step, to its maximum."""
    cluster = Cluster.uniform(4, 4)
    policy = PolluxPolicy(seed=1)
    job = _job("a", max_devices=16)
    sizes = []
    for tick in range(12):
        placement = policy.decide(cluster, [job], 600.0 * (tick + 1)).get("a", {})
        validate_allocation(cluster, [job], {"a": placement})
        size = devices_of(placement)
        assert size <= max(2 * job.explored_devices, 1)
        sizes.append(size)
        job = replace(job, placement=placement, explored_devices=max(job.explored_devices, size), since=600.0 * (tick + 1),
                      restarts=job.restarts + (size != job.devices and job.devices > 0), attained=job.attained + 600.0 * size)
    assert sizes[0] == 1 and max(sizes) == 16, sizes
    assert sizes == sorted(sizes), sizes


def test_pollux_shares_the_cluster_when_jobs_arrive():
    """A fair power mean: a second job is not left waiting while the first holds everything."""
    cluster = Cluster.uniform(1, 4)
    first = _job("a", placement={"node0": 4}, explored_devices=4, since=0.0, attained=4 * 3600.0)
    second = _job("b", arrival=3500.0)
    decision = PolluxPolicy(seed=0).decide(cluster, [first, second], 3600.0)
    assert devices_of(decision.get("b")) >= 1 and devices_of(decision.get("a")) >= 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_pollux_decisions_are_legal(scenario):
    cluster, jobs = scenario
    allocation = PolluxPolicy(generations=5).decide(cluster, jobs, 100_000.0)
    validate_allocation(cluster, jobs, allocation)


@pytest.mark.parametrize("seed", range(6))
def test_the_repair_leaves_only_allocations_the_artifact_allows(seed):
    """Random matrices, many of them illegal on purpose (crowded nodes, jobs over their top,
    spread over more than 16 nodes), come out of the repair legal on every rule."""
    rng = np.random.default_rng(seed)
    cluster = Cluster.uniform(24, 4)
    jobs = [_job(f"j{i}", min_devices=int(rng.integers(1, 3)), max_devices=int(rng.integers(2, 40)),
                 explored_devices=int(rng.integers(0, 20))) for i in range(30)]
    policy = PolluxPolicy(seed=seed)
    capacity = np.full(24, 4)
    problem = _Problem(policy, cluster, jobs, [n.name for n in cluster.nodes], capacity, 1000.0)
    states = rng.integers(0, 5, size=(8, 30, 24)) * (rng.random((8, 30, 24)) < 0.3)
    repaired = problem.repair(states)
    assert (repaired >= 0).all() and (repaired <= states).all()  # the repair only takes devices away
    assert (repaired.sum(axis=1) <= capacity).all()
    replicas, spans = repaired.sum(axis=2), np.count_nonzero(repaired, axis=2)
    assert (replicas <= problem.top[None, :]).all() and (spans <= MAX_JOB_NODES).all()
    assert ((replicas == 0) | (replicas >= problem.low[None, :])).all()
    distributed_on_node = ((repaired > 0) & (spans > 1)[..., None]).sum(axis=1)
    assert (distributed_on_node <= 1).all()
    assert (states != repaired).any()  # the case was illegal to begin with
    legal = problem.repair(repaired)
    assert (legal == repaired).all()  # and a legal matrix is left as it is


def test_pollux_replays_a_workload_with_goodput_jobs_to_the_end():
    cluster = Cluster.uniform(2, 4)
    jobs = [WorkloadJob(f"j{i}", 300.0 * i, 1800.0 * (1 + i % 3), 1 + i % 4, 1, 8, "small", goodput=True) for i in range(8)]
    result = simulate(cluster, jobs, PolluxPolicy(generations=10), SimConfig())
    assert len(result.jobs) == 8 and all(math.isfinite(j.finish) for j in result.jobs)
    assert result.summary()["idle_share"] < 0.5


def test_a_pollux_replay_is_the_same_whatever_the_host_load():
    """No wall-clock budget in a replay: the same seed gives the same schedule (the budget is
    for the decision-time bench only, where a search that overran would fail the 1 s goal)."""
    cluster = Cluster.uniform(2, 4)
    jobs = [WorkloadJob(f"j{i}", 200.0 * i, 1200.0 * (1 + i % 3), 1 + i % 4, 1, 8, "small", goodput=True) for i in range(8)]
    first, second = (simulate(cluster, jobs, PolluxPolicy(generations=10, seed=3), SimConfig(), seed=3) for _ in range(2))
    assert [(j.id, j.finish, j.restarts) for j in first.jobs] == [(j.id, j.finish, j.restarts) for j in second.jobs]
    budgeted = PolluxPolicy(generations=10**6, budget_s=0.05, seed=3)
    started = time.perf_counter()
    budgeted.decide(cluster, [_job("a"), _job("b", arrival=10.0)], 100.0)
    assert time.perf_counter() - started < 5.0  # a million generations asked: the budget ended the search
