"""A campaign's warm worker (training/worker.py) that passes its device on by itself.

When a trial is staged after the one a warm worker runs (flows/run/handover.py), the campaign
writes a ticket for it: the staged trial's request and config, and the lease transaction that
gives it the device. As its trial ends with a result, the worker takes the ticket (a rename:
the campaign unstaging it removes the file instead, so exactly one of the two wins), moves the
device's lease from the ended trial to the staged one in one transaction of the host's lease
file (`LeaseStore.acquire(instead_of=...)`, with the campaign's pid: the campaign renews it
from then on), writes the config with its fence and starts it, and says so in its reply. The
campaign's process, busy catching up with the trial that ended (its records, its MLflow run,
its Prefect task run) on a loaded host, is not on the path from one trial's end to the next
one's first step; it adopts the lease when it reads the reply. A device is still one trial's
at a time: the same process runs them one after the other, under one lease after the other.

Ticket (JSON): {"trial": id, "request": the worker request to run, "config": its TrialConfig
fields without the lease, "lease": {"db", "timeout_s", "holder", "instead_of", "claims",
"capacity", "pid", "campaign"}}. Reply's "next": {"trial", "started", "grant", "at", "offset"}
when a ticket was taken (started False: the campaign starts that trial the usual way).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path

from cluster.leases import LeaseStore
from training import worker
from training.config import TrialConfig
from training.failure import clear_failure
from training.files import write_atomic
from training.train import finished_result

log = logging.getLogger(__name__)

TAKEN = ".taken"  # a ticket's name once a worker took it


def take_ticket(path: str | None) -> dict | None:
    """The ticket at `path`, taken (renamed: see the module's doc), or None if there is none."""
    if not path:
        return None
    try:
        os.rename(path, path + TAKEN)
        return json.loads(Path(path + TAKEN).read_text())
    except (FileNotFoundError, ValueError):
        return None


@functools.cache
def _store(db: str, timeout_s: float) -> LeaseStore:
    """The lease file's store, one per worker: checked (schema, integrity) and its connection
    opened at the first take-over only."""
    return LeaseStore(db, timeout_s)


def pass_device_on(ended: TrialConfig, ticket: dict) -> tuple[dict, dict | None]:
    """`ended` finished in this worker: move its device's lease to the ticket's trial and
    start it. (the reply's "next", the request to run now or None)."""
    lease, trial = ticket["lease"], ticket["trial"]
    refused = {"trial": trial, "started": False}
    if finished_result(ended) is None:  # it stopped without a result (pruned ones have one): the campaign decides
        return refused, None
    store = _store(lease["db"], lease["timeout_s"])
    try:
        granted = store.acquire(lease["holder"], lease["claims"], lease["capacity"], pid=lease["pid"],
                                campaign=lease["campaign"], instead_of=lease["instead_of"])
    except Exception as e:  # a busy or unusable lease file: the campaign's own start says what is wrong
        log.warning("the next trial %s did not start at once: %s: %s", trial, e.__class__.__name__, e)
        return refused, None
    if not granted:  # another campaign's turn: the device was given back, the trial waits its turn
        return refused, None
    config = dataclasses.replace(TrialConfig(**ticket["config"]), lease=store.fence(lease["holder"]))
    grant = store.grant(lease["holder"])
    store.forget(lease["holder"])  # the campaign holds it from its reply on (it adopts the grant)
    request = ticket["request"]
    Path(config.trial_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(request["config"]), config.to_json().encode(), durable=False)  # every launch writes it again
    clear_failure(config.trial_dir)  # what its processes record from now on is this segment's (training.failure)
    log_path = Path(request["log"])
    offset = log_path.stat().st_size if log_path.exists() else 0
    return {"trial": trial, "started": True, "grant": grant, "at": time.time(), "offset": offset}, request


def next_trial(request: dict, code: int) -> tuple[dict, dict | None]:
    """training.worker's hook: after a trial that ended well, the trial staged after it, if any."""
    ticket = take_ticket(request.get("next"))
    if ticket is None:
        return {}, None
    try:
        started, following = pass_device_on(TrialConfig.from_file(request["config"]), ticket)
    except Exception as e:  # nothing started: the campaign starts it the usual way
        log.warning("the next trial %s did not start at once: %s: %s", ticket.get("trial"), e.__class__.__name__, e)
        started, following = {"trial": ticket.get("trial"), "started": False}, None
    return {"next": started}, following


def main(argv: list[str] | None = None) -> None:
    worker.main(argv, next_trial=next_trial)


if __name__ == "__main__":
    main()
