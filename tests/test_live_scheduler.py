"""The live scheduler turns the policy's decisions on real trials into starts and resizes."""

from __future__ import annotations

from flows.run.scheduler import LiveScheduler, live_policy, usable_devices
from cluster.inventory import DeclaredNode, declared_inventory

NODE = {"n": ["n/gpu0", "n/gpu1", "n/gpu2", "n/gpu3"]}


def scheduler() -> LiveScheduler:
    return LiveScheduler(live_policy(resize_pause_s=1.0, min_run_s=5.0), devices_per_node=4)


def test_a_lone_trial_gets_every_device_it_can_use():
    s = scheduler()
    s.arrive("a", 1, 4, now=0.0)
    assert s.decide(NODE, now=0.0).start == {"a": 4}


def test_running_trial_shrinks_when_another_waits():
    s = scheduler()
    s.arrive("a", 1, 4, now=0.0)
    s.running("a", "n", 4, now=0.0)
    s.arrive("b", 1, 4, now=100.0)  # a new trial, long after a's last change
    actions = s.decide(NODE, now=100.0)
    assert actions.start.get("b", 0) >= 1
    assert 1 <= actions.resize["a"] < 4
    assert actions.resize["a"] + actions.start["b"] <= 4


def test_recently_resized_trial_is_left_alone():
    s = scheduler()
    s.arrive("a", 1, 4, now=0.0)
    s.running("a", "n", 4, now=0.0)
    s.arrive("b", 1, 4, now=2.0)  # within min_run_s of a's start
    actions = s.decide(NODE, now=2.0)
    assert "a" not in actions.resize and "b" not in actions.start


def test_finished_trial_frees_devices_for_the_other_to_grow():
    s = scheduler()
    for t in ("a", "b"):
        s.arrive(t, 1, 4, now=0.0)
    s.running("a", "n", 2, now=0.0)
    s.running("b", "n", 2, now=0.0)
    s.finish("a")
    assert s.decide(NODE, now=100.0).resize == {"b": 4}


def test_a_hand_pinned_trial_keeps_its_size_and_its_devices():
    s = scheduler()
    for t in ("a", "b"):
        s.arrive(t, 1, 4, now=0.0)
    s.running("a", "n", 1, now=0.0)
    s.pin("a", 1)
    actions = s.decide(NODE, now=100.0)
    assert "a" not in actions.resize and actions.start == {"b": 3}  # a's device is not handed out


def test_trials_larger_than_what_is_usable_are_clamped_or_wait():
    inventory = declared_inventory([DeclaredNode("n", 4, 2**34)])
    usable = usable_devices(inventory, foreign={"n/gpu0", "n/gpu1", "n/gpu2"})
    assert usable == {"n": ["n/gpu3"]}
    s = scheduler()
    s.arrive("elastic", 1, 4, now=0.0)
    s.arrive("needs-two", 2, 2, now=0.0)
    assert s.decide(usable, now=0.0).start == {"elastic": 1}


def test_a_profiled_trial_starts_from_its_profile_prior_not_a_guess_from_its_size():
    from cluster.throughput import AnalyticStepTime

    scheduler = LiveScheduler(live_policy(resize_pause_s=1.0, min_run_s=10.0), devices_per_node=4)
    profiled = AnalyticStepTime(fixed=0.0, compute=1.0, intra=2.0, inter=4.0, per_node=0.0)  # communication-bound: 2 devices are slower
    scheduler.arrive("profiled", 1, 4, now=0.0, prior=profiled)
    scheduler.arrive("guessed", 1, 4, now=0.0)
    assert scheduler.tracked["profiled"].model.prior is profiled
    assert scheduler.tracked["profiled"].model.step_time(2, 1) > scheduler.tracked["profiled"].model.step_time(1, 1)
    assert scheduler.tracked["guessed"].model.step_time(2, 1) < scheduler.tracked["guessed"].model.step_time(1, 1)


def test_a_trial_preempted_its_budget_of_times_is_not_pushed_off_again():
    one = {"n": ["n/gpu0"]}
    s = scheduler()
    s.arrive("old", 1, 1, now=0.0)
    now = 0.0
    for _ in range(3):  # started, then preempted: three times
        s.running("old", "n", 1, now=now)
        now += 1000.0
        s.running("old", "n", 0, now=now)
    assert s.tracked["old"].preemptions == 3
    s.running("old", "n", 1, now=now)
    s.arrive("new", 1, 1, now=now + 1000.0)  # least attained service would put the new one first
    assert s.decide(one, now=now + 1000.0).resize == {}  # the budget is spent: old keeps its device


def test_a_goodput_trial_that_may_grow_its_batch_gets_one_sized_by_its_measured_noise_scale():
    """Pollux's lever, live: the batch the trial's next size trains with, chosen from its
    measured gradient noise scale; none before one was measured, none for a fixed batch."""
    s = scheduler()
    for trial in ("noisy", "quiet", "unmeasured"):
        s.arrive(trial, 1, 4, now=0.0, max_batch_scale=8.0)
    s.arrive("fixed", 1, 4, now=0.0)
    for trial in ("noisy", "quiet", "fixed"):
        s.observe_noise(trial, {"noisy": 50.0, "quiet": 1e-3, "fixed": 50.0}[trial])
    batch = s.decide({"n": NODE["n"], "m": ["m/gpu0", "m/gpu1", "m/gpu2", "m/gpu3"]}, now=0.0).batch
    assert 1.0 < batch["noisy"] <= 8.0 and batch["quiet"] == 1.0
    assert "unmeasured" not in batch and "fixed" not in batch


def test_the_trial_nearest_its_end_keeps_the_device_its_progress_says():
    """Trials declare their steps; the campaign passes on each trial's progress, and the
    policy lets the one with least work left run rather than the one that has run least."""
    one = {"n": ["n/gpu0"]}
    s = scheduler()
    s.arrive("long", 1, 1, now=0.0, steps=100_000)
    s.running("long", "n", 1, now=0.0)
    s.arrive("short", 1, 1, now=1000.0, steps=10)
    assert s.decide(one, now=1000.0).resize == {"long": 0}  # far from its end: the short newcomer goes first
    s.progressed("long", 5.0)  # ... unless it is nearly done
    assert s.decide(one, now=1000.0).resize == {}


def test_in_a_pool_a_trial_grows_onto_another_node_and_elsewhere_stays_on_its_own():
    two = {"a": ["a/cpu0"], "b": ["b/cpu0"]}
    for multi_node, grown in ((True, {"t": 2}), (False, {})):
        s = LiveScheduler(live_policy(resize_pause_s=1.0, min_run_s=5.0), devices_per_node=1, multi_node=multi_node)
        s.arrive("t", 1, 2, now=0.0)
        assert s.decide(two, now=0.0).start == {"t": 2 if multi_node else 1}
        s.running("t", "a", 1, now=0.0)  # started on one node (its other node was busy then)
        assert s.decide(two, now=100.0).resize == grown
    # A trial across both: a newcomer waits for it to end or shrink; a pinned one keeps both nodes' devices.
    s = LiveScheduler(live_policy(resize_pause_s=1.0, min_run_s=5.0), devices_per_node=1, multi_node=True)
    s.arrive("t", 1, 2, now=0.0)
    s.running("t", {"a": 1, "b": 1}, 2, now=0.0)
    s.pin("t", 2)
    s.arrive("u", 1, 1, now=1.0)
    assert s.decide(two, now=100.0).start == {}


def _half_grown(s: LiveScheduler, trial: str) -> None:
    """`trial` runs on 2 of the node's 4 devices, the other 2 idle: whether it grows to 4 is
    whether the growth wins back a pause over its 100 s run so far (at the prior's speed-up)."""
    s.arrive(trial, 1, 4, now=0.0)
    s.running(trial, "n", 2, now=0.0)


def test_a_growth_must_win_back_the_trials_own_timed_pause():
    cheap, dear = scheduler(), scheduler()
    for s in (cheap, dear):
        _half_grown(s, "a")
    cheap.observe_pause("a", 2.0)
    dear.observe_pause("a", 90.0)  # its last resize stood it still 90 s: two more devices for 100 s do not pay that back
    assert cheap.decide(NODE, now=100.0).resize == {"a": 4}
    assert dear.decide(NODE, now=100.0).resize == {}


def test_a_trial_never_resized_is_priced_at_the_campaigns_median_pause_finished_trials_included():
    s = scheduler()
    for trial, pause in (("x", 80.0), ("y", 90.0), ("z", 0.5)):
        s.arrive(trial, 1, 4, now=0.0)
        s.observe_pause(trial, pause)
        s.finish(trial)
    _half_grown(s, "a")
    assert s.restart_cost_s("a") == 80.0
    assert s.decide(NODE, now=100.0).resize == {}
    s.observe_pause("a", 1.0)  # its own, once timed, over the others'
    assert s.decide(NODE, now=100.0).resize == {"a": 4}
