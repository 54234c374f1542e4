"""A flow run whose campaign died is marked Crashed, by the next `launch`, `resume` or `status`.

A campaign killed outright (SIGKILL, the OOM killer, a reboot) cannot tell Prefect it ended,
and no heartbeat reaches a server that outlives it (the folder's resident server, `campaign
ui`'s, the user's): its flow run would read "Running" forever. Its owner lock says the truth
(flows/run/owner.py: a kernel lock that dies with its holder). So whoever comes next and finds
the campaign without a live owner sets its last flow run (campaign.json's `flow_run_id`) to
Crashed, with a message saying why, and its task runs still running with it. A launch owns the
campaign itself by then; `status` probes the lock. Only a Prefect server that answers is asked:
the one the flow run reported to (campaign.json's `prefect_api`), else the folder's (a temporary
server's runs live in the folder's database too: flows/servers/prefect_db.py).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from tasks.records import CampaignRecord

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
DEAD_STATES = ("running", "interrupted")  # what a killed campaign's record says (the warden's word, or none yet)


def crash_message(record: CampaignRecord) -> str:
    return (f"campaign {record.name}'s process ended without reporting it (killed outright: SIGKILL, the OOM killer, a "
            "reboot), and no process owns the campaign since (its owner lock is free); `campaign resume` continues its "
            "trials from their checkpoints")


def flow_run_state(api: str, flow_run_id: str, timeout_s: float = 2.0) -> str | None:
    """The flow run's state type (RUNNING, CRASHED...) read over HTTP, without importing
    Prefect (`campaign status` stays fast); None if the server does not answer or has no such run."""
    try:
        with urllib.request.urlopen(f"{api.rstrip('/')}/flow_runs/{flow_run_id}", timeout=timeout_s) as response:
            state = (json.load(response).get("state") or {}).get("type")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return state if isinstance(state, str) else None


def mark_crashed(api: str, flow_run_id: str, message: str) -> bool:
    """Set the flow run (and its task runs not yet ended) to Crashed with `message`, through
    Prefect's client; True if it was still running (or pending) and is Crashed now."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Crashed

    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(UUID(flow_run_id))
        except (ObjectNotFound, ValueError):
            return False
        if run.state is None or run.state.is_final():
            return False
        client.set_flow_run_state(run.id, Crashed(message=message), force=True)
        for task_run in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))):
            if task_run.state is not None and not task_run.state.is_final():
                client.set_task_run_state(task_run.id, Crashed(message=f"its flow run crashed: {message}"), force=True)
    return True


def settle_dead_flow_run(record: CampaignRecord | None, campaign_dir: Path, apis: Callable[[], list[str | None]],
                         owned: bool) -> str | None:
    """Mark the campaign's last flow run Crashed when no live process owns the campaign
    (`owned`: this process owns it now, so its previous run is dead); `apis()`: the servers to
    ask after the one the run reported to (asked only when there is something to mark). The
    line to say, or None."""
    from flows.run.owner import run_alive

    if record is None or not record.flow_run_id or record.state not in DEAD_STATES:
        return None
    if not owned and run_alive(campaign_dir):
        return None
    for api in dict.fromkeys(a for a in [record.prefect_api, *apis()] if a):
        state = flow_run_state(api, record.flow_run_id)
        if state is None or state in FINAL:
            continue
        if mark_crashed(api, record.flow_run_id, crash_message(record)):
            return (f"campaign {record.name}'s last flow run ({record.flow_run_id}) was left {state.lower()} by a process "
                    "that died: marked Crashed in Prefect")
    return None
