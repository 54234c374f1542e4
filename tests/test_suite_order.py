"""The suite's own order (tests/conftest.py `suite_order`), held against the scheduler that
`make test` runs it with: pytest-xdist's load scheduling, one test at a time
(`--dist load --maxschedchunk 1`). If xdist ever hands out tests in larger batches again, the
order would no longer be the order they start in (one worker started a 50 s test 13 minutes
in while the others had ended): this fails first."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from conftest import suite_order
from xdist.scheduler.load import LoadScheduling


class FakeWorker:
    """What the scheduler asks of a worker: its id, and the tests it is sent."""

    def __init__(self, name: str, handed_out: list[int]) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []
        self.handed_out = handed_out  # every worker's, in the order sent

    def send_runtest_some(self, indices) -> None:
        self.sent.extend(indices)
        self.handed_out.extend(indices)

    def send_runtest_all(self) -> None:
        raise AssertionError("every test sent to one worker")

    def shutdown(self) -> None:
        self.shutting_down = True


def kind(name: str) -> int:
    return 0 if name.startswith("wait") else 1 if name.startswith("slow") else 2


def hand_out(order: list[str], workers: int, seed: int) -> tuple[list[str], int]:
    """The order tests are handed out in when workers finish them at random, short and long,
    and the most any worker held at once."""
    options = {"tx": [f"{workers}*popen"], "maxschedchunk": 1}
    config = SimpleNamespace(getvalue=options.get, getoption=options.get)
    scheduler = LoadScheduling(config)
    handed_out: list[int] = []
    nodes = [FakeWorker(f"gw{k}", handed_out) for k in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, order)
    scheduler.schedule()
    done, most = {node: 0 for node in nodes}, 0
    rng = random.Random(seed)
    while any(done[node] < len(node.sent) for node in nodes):
        busy = [node for node in nodes if done[node] < len(node.sent)]
        most = max(most, *(len(node.sent) - done[node] for node in busy))
        node = rng.choice(busy)
        index = node.sent[done[node]]
        done[node] += 1
        scheduler.mark_test_complete(node, index, duration=rng.choice([0.01, 30.0]))
    return [order[i] for i in handed_out], most


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_tests_are_handed_out_in_the_suites_order_to_whichever_worker_frees_up(workers):
    items = [f"wait{i}" for i in range(8)] + [f"slow{i}" for i in range(70)] + [f"fast{i}" for i in range(480)]
    order = suite_order(items[1::2] + items[::2], kind)  # collected in any order
    for seed in range(5):
        handed_out, most = hand_out(order, workers, seed)
        # One by one, in this order: a worker holds the test it runs and the next one at most.
        assert handed_out == order and most <= 2


def test_the_waiting_tests_are_spread_through_the_slow_ones_and_the_fast_come_last():
    items = [f"fast{i}" for i in range(30)] + [f"slow{i}" for i in range(70)] + [f"wait{i}" for i in range(8)]
    order = suite_order(items, kind)
    assert sorted(order) == sorted(items)
    kinds = [kind(name) for name in order]
    assert kinds[:78].count(2) == 0 and kinds[78:] == [2] * 30  # the fast ones last
    at = [k for k, name in enumerate(order) if kind(name) == 0]
    assert len(at) == 8 and at[-1] < 78 * 3 // 4 + 1 and min(b - a for a, b in zip(at, at[1:])) >= 6  # never side by side
    assert [name for name in order if kind(name) == 1] == [f"slow{i}" for i in range(70)]  # as collected


def test_without_slow_tests_the_waiting_ones_still_come_first():
    assert suite_order(["fast0", "wait0", "fast1", "wait1"], kind) == ["wait0", "wait1", "fast0", "fast1"]
