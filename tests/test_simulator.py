"""The discrete-event simulator and its workloads: Philly samples, synthetic ones, files."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.jobs import Cluster, InvalidAllocation, Node
from cluster.policy import ElasticPolicy, FifoPolicy, LasPolicy
from cluster.simulator import SimConfig, simulate
from cluster.workloads import (
    SCALING,
    WorkloadError,
    WorkloadJob,
    read_philly,
    read_workload,
    sample_philly,
    synthetic,
    write_workload,
)

PHILLY = Path(__file__).resolve().parent.parent / "data" / "traces" / "philly_jobs.csv.gz"
POLICIES = [ElasticPolicy(), FifoPolicy(), LasPolicy()]
FAST = SimConfig(pause_s=20.0, tick_s=120.0)


@st.composite
def clusters(draw) -> Cluster:
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=6))
    return Cluster(tuple(Node(f"n{i}", tuple(f"n{i}/g{j}" for j in range(s))) for i, s in enumerate(sizes)))


def _fastest_possible(job: WorkloadJob, cluster: Cluster, pause_s: float) -> float:
    """A lower bound on a job's completion time: one pause, then its best speed throughout."""
    truth = job.true_model
    steps = job.duration / truth.step_time(job.requested, cluster.min_nodes(job.requested))
    best = min(truth.step_time(n, k) for n in range(job.min_devices, job.max_devices + 1) for k in range(1, n + 1))
    return pause_s + steps * best


# ---------------------------------------------------------------- properties


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=clusters(), jobs=st.integers(1, 30), seed=st.integers(0, 10_000), which=st.integers(0, 2))
def test_every_job_finishes_no_faster_than_physics_allows(cluster, jobs, seed, which):
    workload = synthetic(cluster, jobs, seed, mean_interarrival_s=300.0, median_duration_s=600.0)
    result = simulate(cluster, workload, POLICIES[which], FAST, seed=seed)  # validates every decision
    assert sorted(r.id for r in result.jobs) == sorted(j.id for j in workload)
    by_id = {j.id: j for j in workload}
    for record in result.jobs:
        assert record.arrival <= record.start < record.finish
        assert record.completion_time >= _fastest_possible(by_id[record.id], cluster, FAST.pause_s) * (1 - 1e-9)
    assert 0.0 < result.utilization <= 1.0 + 1e-9


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=clusters(), seed=st.integers(0, 10_000), which=st.integers(0, 2))
def test_results_are_deterministic_for_a_seed(cluster, seed, which):
    workload = synthetic(cluster, 8, seed, mean_interarrival_s=200.0, median_duration_s=900.0)
    first = simulate(cluster, workload, POLICIES[which], FAST, seed=seed)
    second = simulate(cluster, workload, POLICIES[which], FAST, seed=seed)
    assert first.jobs == second.jobs


def test_a_fixed_size_job_alone_takes_its_duration_plus_one_pause():
    cluster = Cluster.uniform(2, 4)
    job = WorkloadJob("solo", 30.0, 3600.0, 8, 8, 8, "xlarge")
    for policy in (FifoPolicy(), LasPolicy(), ElasticPolicy()):
        (record,) = simulate(cluster, [job], policy, SimConfig(pause_s=25.0)).jobs
        assert record.completion_time == pytest.approx(3625.0)
        assert record.resizes == record.preemptions == 0


def test_an_elastic_job_alone_learns_how_far_it_scales():
    cluster = Cluster.uniform(4, 4)
    # Its prior says spreading over nodes does not pay; one exploration shows it does.
    big = WorkloadJob("solo", 0.0, 36_000.0, 2, 1, 16, "xlarge")
    (fixed,) = simulate(cluster, [big], FifoPolicy()).jobs
    (elastic,) = simulate(cluster, [big], ElasticPolicy()).jobs
    assert elastic.completion_time < 0.35 * fixed.completion_time
    assert elastic.device_seconds / elastic.completion_time > 12  # mostly on all four nodes
    # A small model tries a second node once, then goes back to one: as fast as if known.
    small = replace(big, scaling="small")
    (learned,) = simulate(cluster, [small], ElasticPolicy()).jobs
    (known,) = simulate(cluster, [small], ElasticPolicy(), SimConfig(oracle=True)).jobs
    assert learned.resizes <= 2
    assert learned.completion_time < 1.03 * known.completion_time


def test_starvation_guard_runs_an_old_job_while_new_ones_keep_coming():
    """One device kept busy by a new 280 s job every 300 s for 6 hours, and an older job
    (run long enough that least attained service ranks it under a newcomer even counting
    what the device it holds is worth more to it: `hysteresis`)."""
    cluster = Cluster.uniform(1, 1)
    old = WorkloadJob("old", 0.0, 3600.0, 1, 1, 1, "small")
    stream = [WorkloadJob(f"new{i:03d}", 3000.0 + 300.0 * i, 280.0, 1, 1, 1, "small") for i in range(72)]
    stream_end = stream[-1].arrival

    def finish_of_old(starvation_s: float, know_remaining: bool = False) -> float:
        policy = ElasticPolicy(starvation_s=starvation_s, min_run_s=300.0, know_remaining=know_remaining)
        result = simulate(cluster, [old, *stream], policy, FAST)
        return next(r.finish for r in result.jobs if r.id == "old")

    # Lengths unknown: least attained service pushes the old job off for each newcomer.
    assert finish_of_old(3600.0) < stream_end
    assert finish_of_old(1e9) > stream_end  # without the guard, least-attained-service starves it
    # Lengths known (a trial declares its steps): the old job, nearest its end, runs through.
    assert finish_of_old(1e9, know_remaining=True) < 3700.0


# ---------------------------------------------------------------- broken policies


class _Greedy:
    """Gives every job its max devices on the first node, over-committing it."""

    name = "broken"

    def decide(self, cluster, jobs, now, more_to_come=True):
        return {j.id: {cluster.nodes[0].name: j.max_devices} for j in jobs}


class _BelowMinimum:
    name = "half-gang"

    def decide(self, cluster, jobs, now, more_to_come=True):
        return {j.id: {cluster.nodes[0].name: j.min_devices - 1} for j in jobs if j.min_devices > 1} or {
            j.id: {cluster.nodes[0].name: 1} for j in jobs
        }


class _Idle:
    name = "idle"

    def decide(self, cluster, jobs, now, more_to_come=True):
        return {}


def test_simulator_raises_on_an_over_committed_decision():
    cluster = Cluster.uniform(2, 2)
    workload = [WorkloadJob(f"j{i}", 0.0, 100.0, 2, 1, 2, "small") for i in range(2)]
    with pytest.raises(InvalidAllocation, match=r"policy broken at t=0.0s: node node0 over-committed: 4 devices"):
        simulate(cluster, workload, _Greedy())


def test_simulator_raises_on_a_broken_gang_and_on_an_idle_cluster():
    cluster = Cluster.uniform(2, 2)
    with pytest.raises(InvalidAllocation, match=r"job g: 2 devices outside its range \[3, 4\]"):
        simulate(cluster, [WorkloadJob("g", 0.0, 100.0, 3, 3, 4, "small")], _BelowMinimum())
    with pytest.raises(InvalidAllocation, match="idle"):
        simulate(cluster, [WorkloadJob("w", 0.0, 100.0, 1, 1, 1, "small")], _Idle())


class _FirstOnOne:
    """Runs the first job on one device and lets the rest wait."""

    name = "first-on-one"

    def decide(self, cluster, jobs, now, more_to_come=True):
        first = min(jobs, key=lambda j: (j.arrival, j.id))
        return {first.id: {cluster.nodes[0].name: 1}}


def test_the_simulator_counts_decisions_that_leave_devices_idle_beside_a_job_that_could_use_them():
    cluster = Cluster.uniform(1, 4)
    workload = [WorkloadJob(f"j{i}", 0.0, 600.0, 2, 1, 2, "small") for i in range(2)]
    assert simulate(cluster, workload, _FirstOnOne()).summary()["idle_share"] == 1.0  # every decision did
    assert simulate(cluster, workload, ElasticPolicy()).summary()["idle_share"] == 0.0
    # Free devices a running job could only reach across one more node (slower) do not count.
    two = Cluster.uniform(2, 2)
    spread_only = simulate(two, [WorkloadJob("a", 0.0, 600.0, 4, 2, 4, "small")], _TwoOnFirstNode())
    assert spread_only.summary()["idle_share"] == 0.0


class _TwoOnFirstNode:
    name = "two-on-first-node"

    def decide(self, cluster, jobs, now, more_to_come=True):
        return {jobs[0].id: {cluster.nodes[0].name: 2}}


# ---------------------------------------------------------------- workloads


@pytest.fixture(scope="module")
def philly():
    return read_philly(PHILLY)  # shipped with the repository: never skipped


def test_philly_sample_is_deterministic_and_fits_the_cluster(philly):
    cluster = Cluster.uniform(16, 4)
    sample = sample_philly(philly, cluster, 200, seed=7)
    assert sample == sample_philly(philly, cluster, 200, seed=7)
    assert sample != sample_philly(philly, cluster, 200, seed=8)
    assert len(sample) == 200 and len({j.id for j in sample}) == 200
    assert [j.arrival for j in sample] == sorted(j.arrival for j in sample)
    assert all(0 <= j.arrival < 8 * 3600 and j.duration >= 60 for j in sample)
    assert all(1 == j.min_devices <= j.requested <= j.max_devices <= 64 for j in sample)
    assert {j.scaling for j in sample} <= set(SCALING)


def test_philly_workload_runs_to_completion_under_every_policy(philly):
    cluster = Cluster.uniform(4, 4)
    sample = sample_philly(philly, cluster, 25, seed=3, max_gpu_hours=20.0)
    for policy in POLICIES:
        assert len(simulate(cluster, sample, policy, FAST).jobs) == 25


def test_workload_file_round_trips(tmp_path):
    cluster = Cluster.uniform(2, 4)
    workload = synthetic(cluster, 20, seed=5)
    write_workload(tmp_path / "w.csv", workload)
    assert read_workload(tmp_path / "w.csv", cluster) == workload


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "workload.csv"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, message",
    [
        ("job_id,arrival_s,num_gpus\na,0,1\n", r"missing column\(s\) duration_s"),
        ("job_id,arrival_s,duration_s,num_gpus\na,0,100,1\nb,5,-3,1\n", r"line 3, duration_s: -3 must be > 0"),
        ("job_id,arrival_s,duration_s,num_gpus\na,0,100,16\n", r"line 2, num_gpus: job a asks for 16 devices; the cluster has 8"),
        ("job_id,arrival_s,duration_s,num_gpus\na,soon,100,1\n", r"line 2, arrival_s: 'soon' is not a number"),
        ("job_id,arrival_s,duration_s,num_gpus\na,0,100,1.5\n", r"line 2, num_gpus: 1.5 must be a whole number"),
        ("job_id,arrival_s,duration_s,num_gpus\na,0,100,1\na,1,100,1\n", r"line 3, job_id: 'a' already used on line 2"),
        ("job_id,arrival_s,duration_s,num_gpus,min_gpus\na,0,100,2,3\n", r"line 2, min_gpus/max_gpus"),
        ("job_id,arrival_s,duration_s,num_gpus,scaling\na,0,100,2,huge\n", r"line 2, scaling: 'huge' is not one of"),
    ],
)
def test_bad_workload_rows_are_named(tmp_path, text, message):
    with pytest.raises(WorkloadError, match=message):
        read_workload(_write(tmp_path, text), Cluster.uniform(2, 4))


def test_bad_philly_rows_are_named(tmp_path):
    path = _write(tmp_path, "timestamp,duration,num_gpus\n2017-10-09 07:01:55,66,1\nyesterday,10,1\n")
    with pytest.raises(WorkloadError, match=r"line 3, timestamp: 'yesterday' is not a date-time"):
        read_philly(path)
    path = _write(tmp_path, "timestamp,num_gpus\n2017-10-09 07:01:55,1\n")
    with pytest.raises(WorkloadError, match=r"missing column\(s\) duration"):
        read_philly(path)


def test_simulator_rejects_a_job_larger_than_the_cluster():
    job = WorkloadJob("big", 0.0, 100.0, 4, 1, 4, "small")
    with pytest.raises(WorkloadError, match="job big asks for 4 devices; the cluster has 2"):
        simulate(Cluster.uniform(1, 2), [job], FifoPolicy())
    assert len(simulate(Cluster.uniform(1, 2), [replace(job, requested=2, max_devices=2)], FifoPolicy()).jobs) == 1


# ---------------------------------------------------------------- the bench's floors


def _scheduler_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("scheduler_bench", Path(__file__).resolve().parent.parent / "bench" / "scheduler_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_fixed_batch_floor_is_each_job_alone_at_its_best_size_with_its_batch_fixed():
    """Reproducible mode's floor (bench/scheduler_bench.py): every job alone from its arrival
    at its best size, its batch fixed; a goodput job alone is faster (its batch grows)."""
    bench = _scheduler_bench()
    cluster = Cluster.uniform(8, 4)
    # Large at 8 is fastest on 24 devices, at a speed-up per device of 0.22: alone, it takes them.
    fixed = [WorkloadJob("a", 0.0, 3600.0, 2, 1, 8, "xlarge"), WorkloadJob("b", 600.0, 1800.0, 1, 1, 4, "small"),
             WorkloadJob("c", 900.0, 7200.0, 8, 1, 32, "large")]
    times = bench.alone_times(cluster, fixed, FAST, seed=1)

    def best_packed(job: WorkloadJob) -> float:  # one pause, then its fastest size on the fewest nodes, batch fixed
        truth = job.true_model
        steps = job.duration / truth.step_time(job.requested, cluster.min_nodes(job.requested))
        return FAST.pause_s + steps * min(truth.step_time(n, cluster.min_nodes(n)) for n in range(job.min_devices, job.max_devices + 1))

    assert times == pytest.approx({j.id: best_packed(j) for j in fixed}, rel=1e-9)
    assert bench.alone_bound(cluster, fixed, FAST, seed=1) == pytest.approx(sum(times.values()) / 3)
    adaptive = bench.alone_times(cluster, [replace(j, goodput=True) for j in fixed], FAST, seed=1)
    assert all(adaptive[j.id] < times[j.id] for j in fixed)


def test_the_reproducible_table_says_the_goal_is_out_of_reach_where_the_fixed_batch_floor_or_the_capacity_bound_is_above_it():
    bench = _scheduler_bench()
    pollux = {"avg_jct_s": 3600.0}
    goals = [(name, {}, {"avg_jct_s": 1.2 * 3600}, pollux, 0.9 * 3600, {}, floor * 3600, None if shared is None else shared * 3600)
             for name, floor, shared in (("low", 1.0, None), ("high", 1.1, None), ("shared low", 1.0, 1.04), ("shared high", 1.0, 1.07))]
    table = bench._reproducible_table(goals, "published")
    assert list(table.columns[-1].cells) == ["yes", "no", "yes", "no"]
    assert list(table.columns[3].cells) == ["1.000", "1.100", "1.000", "1.000"]
    assert list(table.columns[4].cells) == ["-", "-", "1.040", "1.070"]


def _policy_variants():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("policy_variants", Path(__file__).resolve().parent.parent / "bench" / "policy_variants.py")
    variants = importlib.util.module_from_spec(spec)
    sys.modules["policy_variants"] = variants  # its dataclass looks its module up there
    spec.loader.exec_module(variants)
    return variants


def test_policy_variants_take_each_knob_as_its_fields_type_and_name_the_knobs_on_a_typo():
    """bench/policy_variants.py: 'rank_q=3,admit_short=0' is ElasticPolicy(rank_q=3.0, admit_short=False)."""
    import dataclasses

    variants = _policy_variants()
    fields = {f.name: f for f in dataclasses.fields(ElasticPolicy)}
    knobs = variants.parse_knobs("rank_q=3, admit_short=0,preemption_budget=2", fields)
    assert knobs == {"rank_q": 3.0, "admit_short": False, "preemption_budget": 2}
    assert type(knobs["preemption_budget"]) is int and ElasticPolicy(**knobs).rank_q == 3.0
    assert variants.parse_knobs("", fields) == {}
    with pytest.raises(SystemExit, match=r"'rank=3': not name=value with name one of .*rank_q"):
        variants.parse_knobs("rank=3", fields)
    with pytest.raises(SystemExit, match="'three' is not a number"):
        variants.parse_knobs("rank_q=three", fields)


def test_policy_variants_name_each_restart_by_what_caused_it():
    variants = _policy_variants()
    kind = variants.restart_kind
    assert kind({"a": 2}, {"a": 2}, 2) is None
    assert kind({"a": 2}, {}, 2) == kind({"a": 2}, None, 2) == "preemption"
    assert kind({"a": 2}, {"b": 2}, 2) == "move"
    assert kind({"a": 1}, {"a": 2}, 2) == "growth up to it"
    assert kind({"a": 2}, {"a": 3}, 2) == kind({"a": 1}, {"a": 3}, 2) == "growth past the request"
    assert kind({"a": 4}, {"a": 3}, 2) == kind({"a": 2}, {"a": 1}, 2) == "shrink"


def test_policy_variants_count_by_kind_every_restart_the_simulator_counts(philly):
    """The kinds add up to the simulator's own restarts, on a Philly sample under our policy."""
    variants = _policy_variants()
    cluster = Cluster.uniform(4, 4)
    sample = sample_philly(philly, cluster, 40, seed=3, max_gpu_hours=40.0, growth=4)  # busy enough to restart jobs (19 times)
    counting = variants.CountingRestarts(ElasticPolicy())
    result = simulate(cluster, sample, counting, FAST)
    restarts = sum(j.restarts for j in result.jobs)
    assert restarts > 0 and sum(counting.counts.values()) == restarts
    assert set(counting.counts) <= set(variants.KINDS) and result.policy == "elastic"


def test_policy_variants_move_a_jobs_request_and_keep_its_work(philly):
    """`--requests max`: each job requests its max, its duration that of the same work at
    that size (its true step times), so the simulator gives it the same steps to run."""
    variants = _policy_variants()
    cluster = Cluster.uniform(4, 4)
    sample = sample_philly(philly, cluster, 20, seed=3, max_gpu_hours=40.0, growth=4)
    moved = [variants.requested_at(job, job.max_devices, cluster) for job in sample]
    assert any(job.requested < job.max_devices for job in sample)
    steps = lambda job: job.duration / job.true_model.step_time(job.requested, cluster.min_nodes(job.requested))
    for before, after in zip(sample, moved):
        assert after.requested == before.max_devices and after.max_devices == before.max_devices
        assert steps(after) == pytest.approx(steps(before), rel=1e-12)
    # Faster at their max, most of them: the same work takes them less time there.
    assert sum(after.duration < before.duration for before, after in zip(sample, moved)) >= len(sample) // 2


def test_policy_variants_total_a_variant_over_draws_of_the_noise():
    """`--noise-seed 0,100`: the mean gap closed at each draw and over them, and each goal
    counted over every (workload, draw) pair, p99 and reproducible at their bounds included."""
    variants = _policy_variants()

    def row(gap, p99, restarts, repro):
        return {"gap": gap, "p99": p99, "restarts": restarts, "pollux_restarts": 2.0, "repro": repro}

    by_seed = {0: [row(0.30, 1.0, 2.0, 1.05), row(0.10, 1.2, 2.5, 1.2)], 100: [row(0.40, 0.9, 1.0, 1.0), row(0.20, 1.01, 3.0, 1.1)]}
    text = variants.totals("v", by_seed)
    assert text.startswith("v, over noise seeds 0, 100: gap closed, mean 25.0 % (20.0 / 30.0)")
    assert "p99 <= Pollux's on 2 of 4" in text and "restarts <= Pollux's on 2 of 4" in text
    assert text.endswith(f"reproducible <= {variants.bench.REPRODUCIBLE_GOAL} on 2 of 4")
