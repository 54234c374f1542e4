"""StopFlag: the ranks of an elastic trial agree on the step at which to stop, whatever the
order in which they look (training/elastic_worker.py). The multi-process resize tests in
test_elastic.py run it for real; here every interleaving the all-reduce allows is checked."""

from __future__ import annotations

import itertools

import pytest
import torch

from training.elastic_host import stop_key
from training.elastic_worker import StopFlag

EVERY = 10
CPU = torch.device("cpu")


def stop_steps(tmp_path, order_at_flag_step: tuple[int, ...], world: int = 3, store=None) -> list[int]:
    """The step at which each rank stops when the agent's file (or, `store`: its key, for a
    generation across nodes) appears just before control step 20 and the ranks look at step
    20 in `order_at_flag_step` (any order is possible: the ranks are in step 20 together,
    between two all-reduces)."""
    path = tmp_path / "stop-0"
    flags = [StopFlag(path, rank, EVERY, CPU, store) for rank in range(world)]
    stopped: dict[int, int] = {}
    assert not any(flag(EVERY) for flag in flags)
    if store is None:
        path.write_text('{"save": false}')
    else:
        store.set(stop_key(path), '{"save": false}')
        assert not path.exists() and all(flag.request() == {"save": False} for flag in flags)
    for step in range(2 * EVERY, 6 * EVERY, EVERY):
        order = order_at_flag_step if step == 2 * EVERY else range(world)
        for rank in order:
            if rank not in stopped and flags[rank](step):
                stopped[rank] = step
    return [stopped.get(rank, -1) for rank in range(world)]


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_every_rank_stops_at_the_same_step_whatever_the_order(tmp_path, order):
    # Rank 0 sees the file at step 20 and names step 40; no rank reaches step 40 without
    # having seen that (the all-reduce of step 20 follows rank 0's write), and none stops earlier.
    assert stop_steps(tmp_path, order) == [4 * EVERY] * 3


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 0, 2)])
def test_across_nodes_the_store_carries_the_same_agreement(tmp_path, order):
    from datetime import timedelta

    from training.loopback import loopback_store

    store = loopback_store(0, timeout=timedelta(seconds=10), wait_for_workers=False)
    assert stop_steps(tmp_path, order, store=store) == [4 * EVERY] * 3


def test_no_file_no_stop(tmp_path):
    flags = [StopFlag(tmp_path / "stop-0", rank, EVERY, CPU) for rank in range(2)]
    assert not any(flag(step) for step in range(EVERY, 100 * EVERY, EVERY) for flag in flags)


def test_a_new_agent_clears_an_earlier_agents_stop_files(tmp_path):
    """Generations are numbered from 0 again by every agent of a trial (a relaunch after a
    crash or a preemption): a stop file left by the last one would stop the new generation 0."""
    from training.elastic import Agent

    control = tmp_path / "control"
    control.mkdir()
    for name in ("stop-0", "stop-0.at", "stop-3"):
        (control / name).write_text("{}")
    (control / "command-000000.json").write_text("{}")
    agent = Agent(tmp_path / "trial.json", control)
    assert sorted(p.name for p in control.iterdir()) == ["command-000000.json"]
    assert agent.stop_path(0) == control / "stop-0"
