"""What one lease transaction costs: a connection kept open between transactions (what
cluster/leases.py does) against one opened and closed for each (what it did before).

    .venv/bin/python bench/lease_txn.py [--pairs 200] [--blocks 6]

The lease file is SQLite in WAL mode with synchronous=FULL. A connection that is the file's
only one makes the WAL as its transaction begins and folds it into the file as it closes
(fsyncs of the WAL, the folder and the file); a kept one commits with one fsync of the WAL.
Each block times `--pairs` acquire + release pairs of one device (the transactions of a
trial's start and end, or of a warm worker passing its device on), in a fresh folder of the
temporary directory's file system; the two ways alternate block by block. Prints each way's
median per transaction and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.leases import LeaseStore, close_kept_connections  # noqa: E402

CAPACITY = {"d0": 10}


def block(pairs: int, kept: bool) -> float:
    """Seconds per transaction over `pairs` acquire + release pairs."""
    with tempfile.TemporaryDirectory() as folder:
        store = LeaseStore(Path(folder) / "leases.db")
        store.leases()  # the file made, outside the timing
        if not kept:
            close_kept_connections()
        started = time.perf_counter()
        for i in range(pairs):
            assert store.acquire(f"trial-{i}", {"d0": 10}, CAPACITY)
            if not kept:
                close_kept_connections()
            store.release(f"trial-{i}")
            if not kept:
                close_kept_connections()
        took = time.perf_counter() - started
        close_kept_connections()
        return took / (2 * pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=6)
    args = parser.parse_args()
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.blocks):
        for kept in (True, False) if i % 2 == 0 else (False, True):
            times[kept].append(block(args.pairs, kept))
    kept, closed = statistics.median(times[True]), statistics.median(times[False])
    print(f"per transaction, median of {args.blocks} blocks of {2 * args.pairs}: kept connection {kept * 1e3:.2f} ms, "
          f"a connection per transaction {closed * 1e3:.2f} ms ({closed / kept:.2f}x)")


if __name__ == "__main__":
    main()
