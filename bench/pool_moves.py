"""How long a pool campaign's moves across nodes stop training, with a shared folder and with nothing shared.

Runs the pool's move test, a real campaign on two network namespaces with real node workers
(`tests/test_pool.py::test_an_elastic_trial_in_a_pool_is_grown_onto_a_second_node_by_the_policy_and_moved_by_hand`):
an elastic trial on node a is grown onto node b by the policy, moved 2 -> 1 -> 2 by
`campaign resize`, node b is killed with SIGKILL, and the trial grows onto b again once it is
back. Every move is in memory (the agent on a, a host segment on b). Each way runs once per
round, in alternating order, so both see the host's load of the same moment. The figures come
from the trial's own record of each move (`resizes.jsonl`), read from the campaign's folder:
- pause: the old size's last step to the new size's first (nothing trains); the test holds the
  trial at its control steps until its next command, and that wait is recorded apart (`held`),
  not in the pause;
- latency: the agent's command to the first step at the new size (for a lost node: the
  agent seeing the loss).
The test needs root and iproute2, as `make test` does for the pool's tests.

    .venv/bin/python bench/pool_moves.py --rounds 2      # as root

Prints one line per move and a table of medians; passes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
TEST = "tests/test_pool.py::test_an_elastic_trial_in_a_pool_is_grown_onto_a_second_node_by_the_policy_and_moved_by_hand"
WAYS = ("shared folder", "nothing shared")


def kind(event: dict) -> str:
    if event["mode"] == "node lost":
        return "node lost"
    return "grow onto b" if len(event["to"]) > len(event["from"]) else "shrink off b"


def one_run(way: str, folder: Path) -> list[dict]:
    """The test run once, its campaign's folder kept: the trial's resize events."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={folder}", f"{TEST}[{way}]"],
                          cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{way}: the test failed:\n{done.stdout[-3000:]}")
    # The campaign's copy of the trial's folder, under its runs folder (with nothing shared, node
    # a's own is beside it, under node-a/, which has none).
    (record,) = [p for p in folder.rglob("resizes.jsonl") if "runs" in p.parts]
    return [json.loads(line) for line in record.read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    console = Console(width=150)
    console.print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores")
    figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
    work = Path(tempfile.mkdtemp(prefix="pool-moves-"))
    try:
        for r in range(args.rounds):
            for way in WAYS[r % 2:] + WAYS[:r % 2]:
                for event in one_run(way, work / f"{way.replace(' ', '-')}-{r}"):
                    figures.setdefault((way, kind(event)), []).append((event["pause_s"], event["latency_s"]))
                    held = event["pause_breakdown_s"].get("held", 0.0)
                    console.print(f"round {r + 1} {way}: {kind(event)} at step {event['step']}: pause {event['pause_s']:.3f} s, "
                                  f"latency {event['latency_s']:.2f} s (held by the test {held:.1f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = Table(title=f"a pool campaign's moves across two nodes, in memory (medians over {args.rounds} round(s))")
    for column in ("way", "move", "moves", "pause s", "latency s"):
        table.add_column(column, justify="left" if column in ("way", "move") else "right")
    for (way, move), rows in sorted(figures.items()):
        table.add_row(way, move, str(len(rows)), f"{statistics.median(p for p, _ in rows):.3f}", f"{statistics.median(l for _, l in rows):.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
