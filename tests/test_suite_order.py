"""The suite's own order (tests/conftest.py `worker_shares`), held against the scheduler that
`make test` runs it with: pytest-xdist's work stealing. If xdist ever cuts its first shares
differently, the slow tests would pile up on one worker again (the pool's tests once ran one
after another on one worker for 15 of a run's 16 minutes): this fails first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import worker_shares
from xdist.scheduler.worksteal import WorkStealingScheduling


class FakeWorker:
    """What the scheduler asks of a worker: its id, and the tests it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices) -> None:
        self.sent.extend(indices)


def kind(name: str) -> int:
    return 0 if name.startswith("wait") else 1 if name.startswith("slow") else 2


def first_shares(order: list[str], workers: int) -> list[list[str]]:
    """The tests xdist's work stealing hands each worker before any finishes."""
    config = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"] if name == "tx" else None)
    scheduler = WorkStealingScheduling(config)
    nodes = [FakeWorker(f"gw{k}") for k in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
    for node in nodes:
        scheduler.add_node_collection(node, order)
    scheduler.schedule()
    return [[order[i] for i in node.sent] for node in nodes]


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_each_worker_starts_with_its_share_of_the_waiting_and_slow_tests(workers):
    items = [f"wait{i}" for i in range(8)] + [f"slow{i}" for i in range(70)] + [f"fast{i}" for i in range(480)]
    items = items[1::2] + items[::2]  # collected in any order
    order = worker_shares(items, workers, kind)
    assert sorted(order) == sorted(items)
    shares = first_shares(order, workers)
    for share in shares:
        counts = [sum(kind(name) == k for name in share) for k in (0, 1)]
        assert abs(counts[0] - 8 / workers) < 1 and abs(sum(counts) - 78 / workers) < 1, shares
        # The waiting tests first, then the other slow ones: none starts after a fast test.
        assert [kind(name) for name in share] == sorted(kind(name) for name in share)


def test_without_workers_the_slow_tests_come_first_in_their_collected_order():
    items = ["fast0", "slow0", "wait0", "fast1", "slow1", "wait1"]
    assert worker_shares(items, 1, kind) == ["wait0", "wait1", "slow0", "slow1", "fast0", "fast1"]
