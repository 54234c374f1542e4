"""The pure scheduling policies and step-time models, over random clusters and job states."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.jobs import (
    Cluster,
    InvalidAllocation,
    Job,
    Node,
    bind_devices,
    devices_of,
    nodes_of,
    speedup,
    validate_allocation,
)
from cluster.goodput import GoodputView
from cluster.policy import ElasticPolicy, FifoPolicy, LasPolicy, NodePool, TiresiasPolicy
from cluster.throughput import AnalyticStepTime, OnlineStepTime, mean_relative_error, prior_from_size

PACKING_POLICIES = [ElasticPolicy(), FifoPolicy(), LasPolicy(), ElasticPolicy(repack=False)]
POLICIES = PACKING_POLICIES + [TiresiasPolicy()]  # Tiresias, as published, takes the emptiest nodes
elastic_policies = st.builds(
    ElasticPolicy,
    hysteresis=st.floats(0.0, 2.0),
    las_scale_s=st.floats(1.0, 1e5),
    las_power=st.floats(0.0, 3.0),
    min_run_s=st.floats(0.0, 1e5),
    min_gain=st.floats(0.0, 1.0),
    starvation_s=st.floats(0.0, 1e6),
    arrival_window_s=st.floats(0.0, 1e4),
)
any_policy = st.one_of(st.sampled_from(POLICIES), elastic_policies)
GOOD_SCALING = AnalyticStepTime(fixed=0.002, compute=1.0, intra=0.005, inter=0.02, per_node=0.001)
POOR_SCALING = AnalyticStepTime(fixed=0.1, compute=0.9, intra=0.06, inter=0.5, per_node=0.02)

# ---------------------------------------------------------------- random states


@st.composite
def clusters(draw) -> Cluster:
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=6))
    return Cluster(tuple(Node(f"n{i}", tuple(f"n{i}/g{j}" for j in range(s))) for i, s in enumerate(sizes)))


@st.composite
def step_models(draw) -> AnalyticStepTime:
    fixed, compute = draw(st.floats(0.0, 0.2)), draw(st.floats(0.05, 2.0))
    intra = draw(st.floats(0.0, 0.3))
    return AnalyticStepTime(fixed, compute, intra, intra * draw(st.floats(1.0, 10.0)), draw(st.floats(0.0, 0.05)))


@st.composite
def job_states(draw, cluster: Cluster, now: float = 100_000.0) -> list[Job]:
    """Active jobs, some running on a valid allocation, with random history."""
    rng: random.Random = draw(st.randoms(use_true_random=False))
    pool = NodePool(cluster)
    jobs = []
    for i in range(draw(st.integers(0, 14))):
        requested = rng.randint(1, cluster.total)
        low, high = rng.randint(1, requested), rng.randint(requested, cluster.total)
        placement: dict[str, int] = {}
        if rng.random() < 0.5:
            placement = pool.place(rng.randint(low, high)) or {}
        arrival = rng.uniform(0, now)
        jobs.append(
            Job(
                f"j{i}",
                arrival,
                requested,
                low,
                high,
                draw(step_models()),
                attained=rng.expovariate(1 / 3600.0) if placement or rng.random() < 0.5 else 0.0,
                placement=placement,
                since=rng.uniform(arrival, now),
                remaining_steps=rng.choice([None, 0.0, rng.expovariate(1 / 5000.0)]),
            )
        )
    return jobs


@st.composite
def scenarios(draw) -> tuple[Cluster, list[Job]]:
    cluster = draw(clusters())
    return cluster, draw(job_states(cluster))


# ---------------------------------------------------------------- every policy


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios(), policy=any_policy)
def test_decisions_are_legal_and_deterministic(scenario, policy):
    cluster, jobs = scenario
    allocation = policy.decide(cluster, jobs, 100_000.0)
    validate_allocation(cluster, jobs, allocation)  # no over-commitment, gangs whole
    for placement in allocation.values():
        assert all(count <= cluster.node(node).size for node, count in placement.items())
    # Same input in another order, same decision.
    assert policy.decide(cluster, list(reversed(jobs)), 100_000.0) == allocation


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios())
def test_elastic_leaves_no_device_idle_that_a_waiting_job_could_start_on(scenario):
    """Whatever the freeze timers say, free devices do not sit next to a job that could run
    on them (issue 24: 43 % of the decisions did, against Pollux)."""
    cluster, jobs = scenario
    now = 100_000.0
    recent = [replace(j, since=now - 10) for j in jobs]  # every timer running
    allocation = ElasticPolicy(starvation_s=math.inf).decide(cluster, recent, now)
    free = cluster.total - sum(devices_of(p) for p in allocation.values())
    for job in recent:
        if not devices_of(allocation.get(job.id)):
            assert job.min_devices > free, (job.id, free)


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios())
def test_no_job_below_its_request_sits_beside_a_free_device_of_its_own_nodes(scenario):
    """Nor does a job the decision shrank (a yield to a shorter job): it restarts anyway, so
    the free devices of the nodes it keeps are its own to grow onto when they make it faster
    (the replay found one such decision on two of the six Philly workloads). A running job
    grows only where the device wins back its pause over its horizon (`_pays`)."""
    cluster, jobs = scenario
    now = 100_000.0
    policy = ElasticPolicy(starvation_s=math.inf)
    allocation = policy.decide(cluster, jobs, now)
    used: dict[str, int] = {}
    for placement in allocation.values():
        for node, count in placement.items():
            used[node] = used.get(node, 0) + count
    for job in jobs:
        held = allocation.get(job.id)
        if not held or devices_of(held) >= min(job.requested, job.max_devices):
            continue
        room = {node: cluster.node(node).size - used.get(node, 0) for node in held}
        for node, free in room.items():
            if free:
                grown = {**held, node: held[node] + min(free, job.max_devices - devices_of(held))}
                horizon = max(policy.min_horizon_s, job.attained / job.devices) if job.running else math.inf
                if job.running and job.remaining_steps is not None:  # a known length bounds it
                    horizon = min(horizon, job.remaining_steps * job.model.step_time(job.devices, nodes_of(job.placement)))
                pause = policy.pause_s if job.running else 0.0
                faster = horizon > pause and speedup(job.model, devices_of(grown), nodes_of(grown)) * (1 - pause / horizon) > \
                    speedup(job.model, devices_of(held), nodes_of(held)) * (1 + 1e-9)
                assert not faster, (job.id, held, node, free)


def test_a_job_started_a_moment_ago_grows_into_idle_devices_up_to_its_request():
    """The case that exposed it: a job's start blocked its growth for grow_after_s, and the
    devices beside it stayed idle while it ran below its request."""
    cluster = Cluster.uniform(1, 4)
    model = AnalyticStepTime(fixed=0.01, compute=1.0, intra=0.01, inter=0.05)
    job = Job("a", 0.0, requested=4, min_devices=1, max_devices=4, model=model, placement={"node0": 2}, since=990.0)
    assert ElasticPolicy(fill_idle=False).decide(cluster, [job], 1000.0) == {"a": {"node0": 2}}  # the old behaviour
    assert ElasticPolicy().decide(cluster, [job], 1000.0) == {"a": {"node0": 4}}


def test_a_fixed_batch_job_that_ends_within_the_growth_wait_grows_at_once():
    """`grow_after_s` keeps a shrunk job from bouncing back; a job just started, never
    resized, that ends before the wait runs out would spend its whole run below its best
    size: it grows now where the growth pays. A resized job, a long one, or one that chooses
    its batch (goodput) still waits."""
    cluster = Cluster.uniform(1, 4)
    now = 100_000.0
    step_s = GOOD_SCALING.step_time(1, 1)
    short = Job("a", now - 60.0, 1, 1, 4, GOOD_SCALING, attained=60.0, placement={"node0": 1}, since=now - 60.0,
                remaining_steps=1800.0 / step_s)
    policy = ElasticPolicy(fill_idle=False)  # growth through the greedy, not into devices left idle
    assert policy.decide(cluster, [short], now) == {"a": {"node0": 4}}
    assert ElasticPolicy(fill_idle=False, early_growth=False).decide(cluster, [short], now) == {"a": {"node0": 1}}
    # Told to ignore lengths (`know_remaining=False`), it cannot tell the job ends soon.
    assert ElasticPolicy(fill_idle=False, know_remaining=False).decide(cluster, [short], now) == {"a": {"node0": 1}}
    assert policy.decide(cluster, [replace(short, restarts=1)], now) == {"a": {"node0": 1}}
    assert policy.decide(cluster, [replace(short, remaining_steps=7200.0 / step_s)], now) == {"a": {"node0": 1}}
    goodput = replace(short, model=GoodputView(GOOD_SCALING, 100.0))
    assert policy.decide(cluster, [goodput], now) == {"a": {"node0": 1}}


def test_a_job_that_ends_in_minutes_does_not_restart_to_grow():
    """A growth pays for its pause within the job's known remaining run, not only within its
    run so far: a job that has run for a day would stop for a minute and restart on four
    devices with 75 s of work left, and end later than if left alone."""
    cluster = Cluster.uniform(1, 4)
    now = 100_000.0
    step_s = GOOD_SCALING.step_time(1, 1)
    ending = Job("a", 0.0, 1, 1, 4, GOOD_SCALING, attained=now, placement={"node0": 1}, since=0.0, remaining_steps=75.0 / step_s)
    assert ElasticPolicy(pause_s=60.0).decide(cluster, [ending], now) == {"a": {"node0": 1}}
    assert ElasticPolicy(pause_s=60.0, remaining_horizon=False).decide(cluster, [ending], now) == {"a": {"node0": 4}}
    long_left = replace(ending, remaining_steps=7200.0 / step_s)
    assert ElasticPolicy(pause_s=60.0).decide(cluster, [long_left], now) == {"a": {"node0": 4}}


def test_under_arrival_pressure_a_job_grows_up_to_its_request_but_not_past_it():
    """`arrival_window_s`: devices free now are wanted again as soon as the recent arrivals'
    rate says; a growth above the request must pay for its pause before then (on the heavy
    Philly workload such growths were undone for newcomers: a third of the restarts)."""
    cluster = Cluster.uniform(1, 8)
    now = 100_000.0
    old = Job("old", 0.0, 2, 1, 8, GOOD_SCALING, attained=1e6, placement={"node0": 2}, since=0.0)
    newcomer = Job("new", now - 60.0, 4, 4, 4, GOOD_SCALING, placement={"node0": 4}, since=now - 60.0)
    # 2 devices spare, 4 requested by the last 10 minutes' arrivals: wanted again within 300 s, the pause.
    assert devices_of(ElasticPolicy(pause_s=300.0).decide(cluster, [old, newcomer], now)["old"]) > 2
    pressed = ElasticPolicy(pause_s=300.0, arrival_window_s=600.0)
    assert pressed.decide(cluster, [old, newcomer], now) == {"old": {"node0": 2}, "new": {"node0": 4}}
    below = replace(old, requested=4)  # below its request, it still takes the idle devices
    assert devices_of(pressed.decide(cluster, [below, newcomer], now)["old"]) == 4
    quiet = replace(newcomer, arrival=now - 700.0)  # no arrival within the window: growth as before
    assert devices_of(pressed.decide(cluster, [old, quiet], now)["old"]) > 2


@settings(max_examples=200, deadline=None)
@given(scenario=scenarios())
def test_elastic_leaves_recently_changed_jobs_whole(scenario):
    """Whole, but for what it holds past its request while a job waits (devices it took when
    they were idle, on loan), and for the devices a far shorter waiting job needs to start
    (`admit_short`): a job changed a moment ago lends at most one waiting job's minimum."""
    cluster, jobs = scenario
    now = 100_000.0
    recent = [replace(j, since=now - 10) if j.running else j for j in jobs]
    someone_waits = any(not j.running for j in recent)

    def kept(job):
        return min(job.devices, max(job.requested, job.min_devices)) if someone_waits else job.devices

    allocation = ElasticPolicy(min_run_s=300.0, admit_short=False).decide(cluster, recent, now)
    for job in recent:
        if job.running:
            assert devices_of(allocation.get(job.id)) >= kept(job), job.id
    lent = max((j.min_devices for j in recent if not j.running), default=0)
    allocation = ElasticPolicy(min_run_s=300.0).decide(cluster, recent, now)
    for job in recent:
        if job.running:
            assert devices_of(allocation.get(job.id)) >= kept(job) - lent, job.id


def test_a_waiting_job_takes_back_what_a_protected_job_holds_past_its_request():
    """Protection keeps a running job its request, not the idle devices it grew into: a
    newcomer gets those back at once, and nothing below the request."""
    cluster = Cluster.uniform(1, 8)
    now = 100_000.0
    grown = Job("grown", 0.0, 4, 1, 8, GOOD_SCALING, attained=8e5, placement={"node0": 8}, since=now - 60.0)
    newcomer = Job("new", now - 30.0, 2, 2, 2, GOOD_SCALING, remaining_steps=10)
    allocation = ElasticPolicy().decide(cluster, [grown, newcomer], now)
    assert devices_of(allocation["new"]) == 2
    assert 4 <= devices_of(allocation["grown"]) <= 6
    # Its request is protected: a newcomer wanting more than the loan waits.
    wide = replace(newcomer, requested=6, min_devices=6, max_devices=6)
    allocation = ElasticPolicy(admit_short=False).decide(cluster, [grown, wide], now)
    assert "new" not in allocation and devices_of(allocation["grown"]) >= 4


@settings(max_examples=300, deadline=None)
@given(scenario=scenarios())
def test_elastic_never_grows_a_job_within_grow_after_s_of_its_last_change(scenario):
    """However many rounds the growths not worth their pause take to settle, a job changed a
    moment ago does not grow (seen: grown minutes after a change, trimmed back, again and again)
    out of the devices the decision hands out; growth into devices left idle is the fill's
    (tested below)."""
    cluster, jobs = scenario
    policy = ElasticPolicy(grow_after_s=3600.0, explore_after_s=math.inf, fill_idle=False)  # exploring is a growth of its own
    now = 100_000.0
    # Resized before (a job never resized that ends within the wait may grow: tested below).
    recent = [replace(j, since=now - 10, restarts=1) if j.running else j for j in jobs]
    allocation = policy.decide(cluster, recent, now)
    for job in recent:
        if job.running:
            assert devices_of(allocation.get(job.id)) <= job.devices, job.id


@settings(max_examples=200, deadline=None)
@given(scenario=scenarios())
def test_elastic_runs_a_starving_job_when_unprotected_devices_allow(scenario):
    cluster, jobs = scenario
    policy = ElasticPolicy(starvation_s=3600.0, min_run_s=300.0)
    now = 100_000.0
    # It has waited longest of all, with the most attained service: LAS alone would never run it.
    starving = Job("starved", -1e6, 1, 1, cluster.total, POOR_SCALING, attained=1e9, since=-1e6)
    allocation = policy.decide(cluster, [*jobs, starving], now)
    protected = sum(j.devices for j in jobs if now - (j.since or 0) < policy.min_run_s)
    if protected + starving.min_devices <= cluster.total:
        assert devices_of(allocation.get("starved")) >= 1


def test_every_policy_packs_a_job_on_the_fewest_nodes():
    cluster = Cluster.uniform(4, 4)
    for policy in POLICIES:
        for size, nodes in ((3, 1), (4, 1), (8, 2)):
            job = Job("a", 0.0, size, size, size, GOOD_SCALING)
            placement = policy.decide(cluster, [job], 10.0)["a"]
            assert (devices_of(placement), nodes_of(placement)) == (size, nodes), policy.name


def test_packing_fills_the_tightest_node_first():
    cluster = Cluster(tuple(Node(n, tuple(f"{n}/g{i}" for i in range(4))) for n in ("a", "b")))
    busy = Job("busy", 0.0, 3, 3, 3, GOOD_SCALING, placement={"a": 3}, since=0.0)
    new = Job("new", 1.0, 1, 1, 1, GOOD_SCALING)
    for policy in PACKING_POLICIES:
        assert policy.decide(cluster, [busy, new], 10.0)["new"] == {"a": 1}, policy.name


# ---------------------------------------------------------------- the elastic policy


def test_elastic_grows_a_lone_job_only_while_it_speeds_up():
    cluster = Cluster.uniform(4, 4)
    scales = Job("good", 0.0, 1, 1, 16, GOOD_SCALING)
    allocation = ElasticPolicy().decide(cluster, [scales], 10.0)
    assert devices_of(allocation["good"]) == 16
    # A small model loses more to the network than it gains past one node: it stays on one.
    poor = Job("poor", 0.0, 1, 1, 16, POOR_SCALING)
    allocation = ElasticPolicy().decide(cluster, [poor], 10.0)
    assert (devices_of(allocation["poor"]), nodes_of(allocation["poor"])) == (4, 1)


def test_elastic_shares_between_jobs_by_marginal_speedup():
    cluster = Cluster.uniform(1, 8)
    good = Job("good", 0.0, 4, 1, 8, GOOD_SCALING)
    poor = Job("poor", 0.0, 4, 1, 8, POOR_SCALING)
    allocation = ElasticPolicy().decide(cluster, [good, poor], 10.0)
    assert devices_of(allocation["good"]) > devices_of(allocation["poor"]) >= 1
    assert devices_of(allocation["good"]) + devices_of(allocation["poor"]) == 8


def test_elastic_skips_a_resize_too_small_to_pay_for_its_pause():
    cluster = Cluster.uniform(1, 4)
    # Two devices to four: 0.5% faster at best. Not worth a 20 s pause.
    flat = AnalyticStepTime(fixed=1.0, compute=0.01, intra=0.0, inter=0.0)
    job = Job("flat", 0.0, 2, 1, 4, flat, attained=7200.0, placement={"node0": 2}, since=0.0)
    assert ElasticPolicy().decide(cluster, [job], 7200.0)["flat"] == {"node0": 2}
    steep = Job("steep", 0.0, 2, 1, 4, GOOD_SCALING, attained=7200.0, placement={"node0": 2}, since=0.0)
    assert ElasticPolicy().decide(cluster, [steep], 7200.0)["steep"] == {"node0": 4}


def test_elastic_lets_a_long_job_try_one_more_node_with_idle_devices():
    cluster = Cluster.uniform(4, 4)
    running = Job("long", 0.0, 1, 1, 16, POOR_SCALING, attained=4 * 3600.0, placement={"node0": 4}, since=0.0, explored_nodes=1)
    allocation = ElasticPolicy().decide(cluster, [running], 3600.0)
    assert (devices_of(allocation["long"]), nodes_of(allocation["long"])) == (8, 2)
    # Once measured on two nodes, its model is believed: back to the one node it prefers.
    tried = replace(running, placement=allocation["long"], explored_nodes=2)
    allocation = ElasticPolicy().decide(cluster, [tried], 7200.0)
    assert (devices_of(allocation["long"]), nodes_of(allocation["long"])) == (4, 1)
    # A young job does not explore: the pauses would cost it more than it could learn.
    young = replace(running, attained=600.0)
    assert ElasticPolicy().decide(cluster, [young], 3600.0)["long"] == {"node0": 4}


def test_elastic_gives_a_new_job_devices_from_a_long_running_one():
    cluster = Cluster.uniform(1, 4)
    old = Job("old", 0.0, 4, 1, 4, GOOD_SCALING, attained=40 * 3600.0, placement={"node0": 4}, since=0.0)
    new = Job("new", 36_000.0, 1, 1, 4, GOOD_SCALING)
    allocation = ElasticPolicy().decide(cluster, [old, new], 36_000.0)
    assert devices_of(allocation.get("new")) >= 1
    assert devices_of(allocation.get("old")) + devices_of(allocation["new"]) == 4  # none idle


def test_elastic_lets_a_job_near_its_known_end_finish_before_a_longer_newcomer():
    """A trial declares its steps: shortest remaining work first beats least attained
    service, which would push off a job with minutes left for one with hours to go."""
    cluster = Cluster.uniform(1, 1)
    old = Job("old", 0.0, 1, 1, 1, GOOD_SCALING, attained=20 * 3600.0, placement={"node0": 1}, since=0.0, remaining_steps=100.0)
    new = Job("new", 72_000.0, 1, 1, 1, GOOD_SCALING, remaining_steps=36_000.0)
    assert ElasticPolicy().decide(cluster, [old, new], 72_000.0) == {"old": {"node0": 1}}
    # A newcomer shorter than what the old job has left takes the device.
    assert ElasticPolicy().decide(cluster, [replace(old, remaining_steps=36_000.0), replace(new, remaining_steps=100.0)], 72_000.0) == {"new": {"node0": 1}}
    # Lengths unknown (or ignored): least attained service, the young job first.
    unknown = [replace(old, remaining_steps=None), replace(new, remaining_steps=None)]
    assert ElasticPolicy().decide(cluster, unknown, 72_000.0) == {"new": {"node0": 1}}
    assert ElasticPolicy(know_remaining=False).decide(cluster, [old, new], 72_000.0) == {"new": {"node0": 1}}


def test_known_lengths_weigh_jobs_by_rank_so_a_long_job_keeps_a_share_whatever_its_length():
    """heSRPT's weights: the shortest job weighs most, but the longest one's weight is set by
    its rank, not its length. Where speed-up per device falls (poor scaling), the shorter
    jobs' last devices are worth less than the long job's first: it runs beside them, at the
    same share whether it has ten thousand steps left or ten million."""
    cluster = Cluster.uniform(2, 4)

    def jobs(long_steps: float) -> list[Job]:
        return [Job("short", 0.0, 2, 1, 8, POOR_SCALING, remaining_steps=100.0),
                Job("mid", 0.0, 2, 1, 8, POOR_SCALING, remaining_steps=1000.0),
                Job("long", 0.0, 2, 1, 8, POOR_SCALING, remaining_steps=long_steps)]

    for long_steps in (1e4, 1e7):
        allocation = ElasticPolicy().decide(cluster, jobs(long_steps), 0.0)
        assert devices_of(allocation["short"]) == 4 and devices_of(allocation["long"]) == 1
        assert devices_of(allocation["mid"]) == 3
        # Weighed by length instead (1 / remaining), the long job gets nothing.
        assert "long" not in ElasticPolicy(rank_q=0.0).decide(cluster, jobs(long_steps), 0.0)
    # One length unknown: no ranks to compare, every job back on least attained service.
    mixed = jobs(1e4)
    mixed[2] = replace(mixed[2], remaining_steps=None)
    assert ElasticPolicy().decide(cluster, mixed, 0.0) == ElasticPolicy(rank_q=0.0).decide(cluster, mixed, 0.0)


def test_past_its_request_a_job_grows_only_while_its_speed_up_per_device_is_at_least_min_efficiency():
    """Devices others want do not go to a short job's flat end (under half a lone device's
    speed per device past its request); devices nobody else wants still do."""
    cluster = Cluster.uniform(1, 8)
    flat = AnalyticStepTime(fixed=0.4, compute=1.0, intra=0.0, inter=0.0, per_node=0.0)  # speed-up per device 0.54 at 4, 0.47 at 5
    assert speedup(flat, 4, 1) / 4 >= 0.5 > speedup(flat, 5, 1) / 5
    short = Job("short", 0.0, 1, 1, 8, flat, remaining_steps=10.0)
    long = Job("long", 0.0, 1, 1, 8, POOR_SCALING, remaining_steps=1e6)

    def sizes(policy: ElasticPolicy, jobs: list[Job]) -> dict[str, int]:
        return {job_id: devices_of(placement) for job_id, placement in policy.decide(cluster, jobs, 0.0).items()}

    assert sizes(ElasticPolicy(), [short, long]) == {"short": 4, "long": 4}
    # Without the bound, the short job's weight takes it to 5 devices at 0.47 each.
    assert sizes(ElasticPolicy(min_efficiency=0.0), [short, long]) == {"short": 5, "long": 3}
    # Alone, it takes every device that speeds it up.
    assert sizes(ElasticPolicy(), [short]) == {"short": 8}
    # Up to its request the bound does not apply: asking for 5, it gets 5 beside the long job.
    assert sizes(ElasticPolicy(), [replace(short, requested=5), long]) == {"short": 5, "long": 3}


def test_a_critical_boost_weighs_more_the_job_that_finishes_last_whatever_is_done():
    """Opt-in (`critical_boost`): a job whose work left at its fastest size outlasts all the
    other jobs' work on the rest of the cluster weighs that many times its rank's weight; one
    that does not is weighed as before."""
    cluster = Cluster.uniform(2, 4)

    def jobs(long_steps: float) -> list[Job]:
        return [Job("short", 0.0, 2, 1, 8, GOOD_SCALING, remaining_steps=100.0),
                Job("mid", 0.0, 2, 1, 8, GOOD_SCALING, remaining_steps=1000.0),
                Job("long", 0.0, 2, 1, 8, GOOD_SCALING, remaining_steps=long_steps)]

    boosted = ElasticPolicy(critical_boost=4.0)
    plain = ElasticPolicy().decide(cluster, jobs(3000.0), 0.0)
    assert "long" not in plain and boosted.decide(cluster, jobs(3000.0), 0.0) == plain  # not critical: as before
    assert "long" not in ElasticPolicy().decide(cluster, jobs(1e4), 0.0)
    assert devices_of(boosted.decide(cluster, jobs(1e4), 0.0)["long"]) == 4


def test_rank_weights_do_not_stop_a_job_for_a_newcomer_barely_shorter_than_itself():
    """Two jobs within `rank_tie` of each other share their ranks' weight: once the running
    job's protection has expired, a newcomer 5 % shorter does not take its device; one a
    third as long does."""
    cluster = Cluster.uniform(1, 1)
    now = 36_000.0
    running = Job("running", 0.0, 1, 1, 1, GOOD_SCALING, attained=now, placement={"node0": 1}, since=0.0, remaining_steps=1000.0)
    newcomer = Job("new", now, 1, 1, 1, GOOD_SCALING, remaining_steps=950.0)
    assert ElasticPolicy().decide(cluster, [running, newcomer], now) == {"running": {"node0": 1}}
    assert ElasticPolicy(rank_tie=1.0).decide(cluster, [running, newcomer], now) == {"new": {"node0": 1}}
    assert ElasticPolicy().decide(cluster, [running, replace(newcomer, remaining_steps=300.0)], now) == {"new": {"node0": 1}}


def test_a_job_takes_idle_devices_only_while_each_still_gives_its_fill_efficiency():
    """Idle devices go to whoever gains from them, but a fixed batch split past a third of a
    lone device's speed per device is not worth holding them (the job keeps them for its
    protection, and newcomers find them taken): past its request it stops there. A goodput
    job (its batch grows with its devices) has a bound of its own, `goodput_fill_efficiency`."""
    cluster = Cluster.uniform(1, 16)
    flat = AnalyticStepTime(fixed=0.4, compute=1.0, intra=0.0, inter=0.0, per_node=0.0)  # speed-up per device 0.30 at 9, 0.28 at 10
    assert speedup(flat, 9, 1) / 9 >= 0.3 > speedup(flat, 10, 1) / 10
    fixed = Job("fixed", 0.0, 1, 1, 16, flat, remaining_steps=1e5)
    adaptive = replace(fixed, model=GoodputView(flat, 0.0))  # no gradient noise: the same speed-ups as the fixed batch
    assert speedup(adaptive.model, 16, 1) == pytest.approx(speedup(flat, 16, 1))

    def size(policy: ElasticPolicy, job: Job) -> int:
        return devices_of(policy.decide(cluster, [job], 0.0)[job.id])

    assert size(ElasticPolicy(), fixed) == 9
    assert size(ElasticPolicy(fixed_fill_efficiency=0.0), fixed) == 16
    # Each kind of job is held by its own bound only.
    assert size(ElasticPolicy(), adaptive) == 9
    assert size(ElasticPolicy(goodput_fill_efficiency=0.0), adaptive) == 16
    assert size(ElasticPolicy(fixed_fill_efficiency=0.0), adaptive) == 9
    assert size(ElasticPolicy(goodput_fill_efficiency=0.0), fixed) == 9
    # Up to its request (or what it holds) the bound does not apply.
    assert size(ElasticPolicy(), replace(fixed, requested=12)) == 12
    assert size(ElasticPolicy(), replace(adaptive, requested=12)) == 12
    # A running goodput job already past the bound keeps what it holds: the bound limits growth, not what is held.
    held = replace(adaptive, placement={"node0": 12}, since=0.0, attained=3600.0 * 12)
    assert size(ElasticPolicy(), held) == 12
    # The bound keeps devices for jobs to come: with none to come, nothing is kept for them.
    for job in (fixed, adaptive):
        assert devices_of(ElasticPolicy().decide(cluster, [job], 0.0, more_to_come=False)[job.id]) == 16


def test_elastic_lets_a_far_shorter_newcomer_into_what_a_protected_job_grew_onto():
    """A job grown past its request is protected for `min_run_s` after the change, but not
    against a waiting job with a small fraction of its work left: it is protected only down
    to its minimum and the newcomer starts now (Pollux, which protects nothing, started short
    jobs 7x sooner). It starts at its minimum: what the long job holds past its request
    (idle devices when it took them) weighs `loan_hysteresis` times more to it, so that it is
    not shrunk further for what one more device gives the newcomer."""
    cluster = Cluster.uniform(1, 4)
    now = 36_000.0
    grown = Job("grown", 0.0, 2, 1, 4, GOOD_SCALING, attained=30_000.0, placement={"node0": 4}, since=now - 3000.0,
                remaining_steps=36_000.0)
    short = Job("short", now, 2, 1, 2, GOOD_SCALING, remaining_steps=100.0)
    allocation = ElasticPolicy().decide(cluster, [grown, short], now)
    assert allocation == {"grown": {"node0": 3}, "short": {"node0": 1}}
    assert devices_of(ElasticPolicy(loan_hysteresis=0.8).decide(cluster, [grown, short], now)["short"]) == 2
    # Not far shorter (over yield_ratio of the protected job's work): the protection holds.
    assert ElasticPolicy().decide(cluster, [grown, replace(short, remaining_steps=20_000.0)], now) == {"grown": {"node0": 4}}
    # Changed under `yield_min_s` ago: it is not yielded down again so soon; it lends the
    # newcomer only the device it needs to start (`admit_short`), or nothing with that off.
    recent = replace(grown, since=now - 600.0)
    assert ElasticPolicy().decide(cluster, [recent, short], now) == {"grown": {"node0": 3}, "short": {"node0": 1}}
    assert ElasticPolicy(admit_short=False).decide(cluster, [recent, short], now) == {"grown": {"node0": 4}}
    # The rule off: the protection holds (the newcomer's rank weighs too little to take
    # back the loan). Lengths unknown: a newcomer's least attained service weighs far more,
    # and it takes back the loan, but not the request.
    assert ElasticPolicy(yield_ratio=0.0).decide(cluster, [grown, short], now) == {"grown": {"node0": 4}}
    unknown = [replace(grown, remaining_steps=None), replace(short, remaining_steps=None)]
    assert ElasticPolicy().decide(cluster, unknown, now) == {"grown": {"node0": 2}, "short": {"node0": 2}}
    wide = [replace(job, requested=4) if job.id == "grown" else job for job in unknown]
    assert ElasticPolicy().decide(cluster, wide, now) == {"grown": {"node0": 4}}


def test_a_far_shorter_newcomer_the_held_devices_keep_out_waits_only_for_a_finish_sooner_than_its_run():
    """The floors leave room, but what the long job holds is worth more to it than to the
    newcomer (`hysteresis`, `loan_hysteresis`): the newcomer is held for a finish that comes
    within two pauses and its own run, and starts now when the soonest finish is further off."""
    cluster = Cluster.uniform(1, 5)
    now = 36_000.0
    grown = Job("grown", 0.0, 2, 1, 4, GOOD_SCALING, attained=30_000.0, placement={"node0": 4}, since=now - 3000.0,
                remaining_steps=36_000.0)
    short = Job("short", now, 2, 1, 2, GOOD_SCALING, remaining_steps=100.0)
    ending = Job("ending", 0.0, 1, 1, 1, GOOD_SCALING, attained=30_000.0, placement={"node0": 1}, since=0.0, remaining_steps=5.0)
    assert ElasticPolicy().decide(cluster, [grown, short, ending], now) == {"grown": {"node0": 4}, "ending": {"node0": 1}}
    later = replace(ending, remaining_steps=5_000.0)
    allocation = ElasticPolicy().decide(cluster, [grown, short, later], now)
    assert devices_of(allocation["short"]) >= 1 and devices_of(allocation["grown"]) >= 2 and allocation["ending"] == {"node0": 1}


def test_a_short_newcomer_starts_at_once_when_a_protected_long_job_lending_it_a_device_costs_less_than_waiting():
    """The timers keep long jobs from churning, not a short job from starting: a job of
    minutes arriving in a full cluster starts in the same decision on a device of a long job
    changed minutes ago (still protected by `min_run_s` and `yield_min_s`), because the long
    job's delay (two pauses and a device's share over the short run) is under the wait for
    the soonest finish; when a running job ends sooner than that, the newcomer waits for it."""
    cluster = Cluster.uniform(1, 4)
    now = 36_000.0
    long = Job("long", 0.0, 4, 1, 4, GOOD_SCALING, attained=30_000.0, placement={"node0": 4}, since=now - 600.0,
               remaining_steps=36_000.0)
    short = Job("short", now, 1, 1, 1, GOOD_SCALING, remaining_steps=100.0)
    allocation = ElasticPolicy().decide(cluster, [long, short], now)
    assert devices_of(allocation["short"]) == 1 and devices_of(allocation["long"]) == 3
    # Off: the newcomer waits out the protection.
    assert ElasticPolicy(admit_short=False).decide(cluster, [long, short], now) == {"long": {"node0": 4}}
    # Not far shorter than the long job: no loan.
    assert "short" not in ElasticPolicy().decide(cluster, [long, replace(short, remaining_steps=20_000.0)], now)
    # A run too long to be worth a device of the long job against a finish soon: it waits for
    # the finish (held briefly rather than shrinking the long one).
    ending = Job("ending", 0.0, 1, 1, 1, GOOD_SCALING, attained=600.0, placement={"node0": 1}, since=now - 600.0, remaining_steps=30.0)
    three = replace(long, placement={"node0": 3})
    assert "short" not in ElasticPolicy().decide(cluster, [three, ending, short], now)
    # Lengths unknown: nothing to price the loan with.
    unknown = [replace(long, remaining_steps=None), replace(short, remaining_steps=None)]
    assert ElasticPolicy().decide(cluster, unknown, now) == {"long": {"node0": 4}}


def test_elastic_repacks_a_spread_job_onto_one_node_when_it_pays():
    cluster = Cluster.uniform(3, 4)
    spread = Job("spread", 0.0, 4, 4, 4, POOR_SCALING, attained=4 * 7200.0, placement={"node0": 2, "node1": 2}, since=0.0)
    other = Job("other", 0.0, 2, 2, 2, POOR_SCALING, attained=2 * 7200.0, placement={"node0": 2}, since=0.0)
    allocation = ElasticPolicy().decide(cluster, [spread, other], 7200.0)
    assert nodes_of(allocation["spread"]) == 1 and devices_of(allocation["spread"]) == 4  # moved whole to a free node
    assert allocation["other"] == {"node0": 2}  # untouched
    assert ElasticPolicy(repack=False).decide(cluster, [spread, other], 7200.0)["spread"] == {"node0": 2, "node1": 2}
    # A job near its end (a short horizon) would not earn back the pause: it stays.
    young = replace(spread, attained=4 * 30.0, since=0.0)
    assert ElasticPolicy(min_horizon_s=30.0, min_run_s=0.0).decide(cluster, [young, other], 7200.0)["spread"] == {"node0": 2, "node1": 2}


def test_elastic_stops_pushing_off_a_job_preempted_its_budget_of_times():
    cluster = Cluster.uniform(1, 1)
    old = Job("old", 0.0, 1, 1, 1, GOOD_SCALING, attained=20 * 3600.0, placement={"node0": 1}, since=0.0)
    new = Job("new", 72_000.0, 1, 1, 1, GOOD_SCALING)
    policy = ElasticPolicy(preemption_budget=3)
    assert policy.decide(cluster, [replace(old, preemptions=2), new], 72_000.0) == {"new": {"node0": 1}}  # LAS: the young job first
    assert policy.decide(cluster, [replace(old, preemptions=3), new], 72_000.0) == {"old": {"node0": 1}}  # budget spent: it keeps on


# ---------------------------------------------------------------- baselines


def test_tiresias_runs_two_queues_first_come_first_served_and_takes_the_emptiest_nodes():
    cluster = Cluster.uniform(2, 4)
    long = Job("long", 0.0, 4, 4, 4, GOOD_SCALING, attained=17 * 3600.0, placement={"node0": 4}, since=0.0)
    a = Job("a", 10.0, 4, 4, 4, GOOD_SCALING, attained=3600.0, placement={"node1": 4}, since=10.0)
    b = Job("b", 20.0, 2, 2, 2, GOOD_SCALING)
    # Past 16 GPU-hours `long` is in the second queue: the new job takes its place; `a`, in the
    # first queue since it arrived, is not preempted for the younger `b` (first come first served).
    assert TiresiasPolicy().decide(cluster, [long, a, b], 30.0) == {"a": {"node1": 4}, "b": {"node0": 2}}
    # New jobs take devices from the node with the most free, spreading rather than consolidating.
    c = Job("c", 0.0, 3, 3, 3, GOOD_SCALING)
    d = Job("d", 1.0, 1, 1, 1, GOOD_SCALING, attained=1.0, placement={"node0": 1}, since=1.0)
    assert TiresiasPolicy().decide(Cluster.uniform(2, 2), [c, d], 2.0) == {"d": {"node0": 1}, "c": {"node1": 2, "node0": 1}}



def test_fifo_keeps_order_and_never_preempts():
    cluster = Cluster.uniform(1, 4)
    running = Job("first", 0.0, 3, 3, 3, GOOD_SCALING, attained=1e6, placement={"node0": 3}, since=0.0)
    big = Job("second", 1.0, 2, 2, 2, GOOD_SCALING)
    small = Job("third", 2.0, 1, 1, 1, GOOD_SCALING)
    allocation = FifoPolicy().decide(cluster, [running, big, small], 10.0)
    assert allocation == {"first": {"node0": 3}}  # the 2-device job blocks the 1-device one
    allocation = FifoPolicy(backfill=True).decide(cluster, [running, big, small], 10.0)
    assert allocation == {"first": {"node0": 3}, "third": {"node0": 1}}


def test_las_preempts_the_job_with_most_attained_service():
    cluster = Cluster.uniform(1, 4)
    old = Job("old", 0.0, 4, 4, 4, GOOD_SCALING, attained=17 * 3600.0 * 4, placement={"node0": 4}, since=0.0)
    new = Job("new", 10.0, 2, 2, 2, GOOD_SCALING)
    assert LasPolicy().decide(cluster, [old, new], 20.0) == {"new": {"node0": 2}}
    assert LasPolicy().decide(cluster, [replace(old, attained=60.0), new], 20.0) == {"old": {"node0": 4}}


# ---------------------------------------------------------------- allocation checks


def test_validate_allocation_names_what_is_wrong():
    cluster = Cluster.uniform(2, 2)
    a = Job("a", 0.0, 2, 2, 3, GOOD_SCALING)
    b = Job("b", 0.0, 1, 1, 1, GOOD_SCALING)
    with pytest.raises(InvalidAllocation, match="node0 over-committed"):
        validate_allocation(cluster, [a, b], {"a": {"node0": 2}, "b": {"node0": 1}})
    with pytest.raises(InvalidAllocation, match="job a: 1 devices outside"):
        validate_allocation(cluster, [a, b], {"a": {"node1": 1}})
    with pytest.raises(InvalidAllocation, match="unknown node"):
        validate_allocation(cluster, [a, b], {"b": {"elsewhere": 1}})
    with pytest.raises(InvalidAllocation, match="not active"):
        validate_allocation(cluster, [a], {"b": {"node0": 1}})
    validate_allocation(cluster, [a, b], {"a": {"node0": 1, "node1": 2}, "b": {"node0": 1}})


def test_bind_devices_keeps_held_devices_and_never_shares_one():
    cluster = Cluster.uniform(2, 4)
    previous = {"a": ("node0/gpu2", "node0/gpu3"), "b": ("node1/gpu0",)}
    bound = bind_devices(cluster, {"a": {"node0": 3}, "b": {"node1": 1}, "c": {"node0": 1, "node1": 2}}, previous)
    assert set(previous["a"]) <= set(bound["a"]) and len(bound["a"]) == 3
    assert bound["b"] == ("node1/gpu0",)
    everything = [d for ids in bound.values() for d in ids]
    assert len(everything) == len(set(everything)) == 7
    assert sum(d.startswith("node1/") for d in bound["c"]) == 2


# ---------------------------------------------------------------- step-time models


def test_prior_from_size_meets_its_efficiency_at_the_requested_size():
    for requested in (2, 4, 8, 16, 32):
        prior = prior_from_size(requested, devices_per_node=4, efficiency=0.75)
        nodes = math.ceil(requested / 4)
        efficiency = prior.step_time(1, 1) / (requested * prior.step_time(requested, nodes))
        assert efficiency >= 0.75 - 1e-9
        assert prior.step_time(requested, nodes + 1) > prior.step_time(requested, nodes)
    # Asking for many devices says the job scales: exactly the efficiency asked, not less.
    big = prior_from_size(32, devices_per_node=4, efficiency=0.75)
    assert big.step_time(1, 1) / (32 * big.step_time(32, 8)) == pytest.approx(0.75)


@settings(max_examples=40, deadline=None)
@given(truth=step_models(), seed=st.integers(0, 1000))
def test_online_model_converges_to_measured_step_times(truth, seed):
    rng = random.Random(seed)
    model = OnlineStepTime(prior_from_size(1, 4), max_devices=16, devices_per_node=4)
    measured = [(1, 1), (2, 1), (4, 1), (8, 2)]
    errors = []
    for round_ in range(30):
        for n, k in measured:
            model.observe(n, k, truth.step_time(n, k) * rng.lognormvariate(0.0, 0.03))
        if round_ in (0, 29):
            errors.append(mean_relative_error(model, truth, measured))
    assert errors[-1] < 0.02  # within noise of the truth where it was measured
    assert errors[-1] <= errors[0] + 0.01


def test_online_model_learns_the_shape_beyond_measured_sizes():
    truth = AnalyticStepTime(fixed=0.01, compute=0.4, intra=0.02, inter=0.15, per_node=0.005)
    prior = prior_from_size(4, 4)
    model = OnlineStepTime(prior, max_devices=16, devices_per_node=4)
    unseen = [(3, 1), (6, 2), (16, 4)]
    # The prior at the right scale: what is left to learn is the shape.
    before = mean_relative_error(prior.scaled(truth.step_time(1, 1)), truth, unseen)
    for _ in range(5):
        for n, k in ((1, 1), (2, 1), (4, 1), (8, 2), (12, 3)):
            model.observe(n, k, truth.step_time(n, k))
    assert mean_relative_error(model, truth, unseen) < min(before / 3, 0.1)


def test_online_model_follows_any_prior_until_it_measures():
    class Profiled:  # a prior that is not analytic, like the per-layer profile's
        def step_time(self, devices: int, nodes: int = 1) -> float:
            return 0.3 / devices + 0.05 * (devices > 1) + 0.2 * (nodes - 1)

    model = OnlineStepTime(Profiled(), max_devices=16, devices_per_node=4)
    configs = [(1, 1), (2, 1), (4, 1), (8, 2), (16, 4)]
    assert mean_relative_error(model, Profiled(), configs) < 0.1
    for _ in range(3):
        model.observe(4, 1, 2 * Profiled().step_time(4, 1))  # twice slower than profiled
    assert model.step_time(4, 1) == pytest.approx(2 * Profiled().step_time(4, 1), rel=0.05)
    assert model.step_time(1, 1) > 1.5 * Profiled().step_time(1, 1)


def test_online_model_rejects_nonsense_reports():
    model = OnlineStepTime(prior_from_size(1, 4))
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            model.observe(1, 1, bad)
