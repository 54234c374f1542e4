"""The two files by which a pool trial's agent and its hosts on other nodes find each other:
the one shape the pool's segments write and the campaign reads.

- `control/agent-store.json` (`AgentStore`): where the agent's store listens, on its node's
  address. The agent's segment writes it once its port is chosen; the campaign reads it to
  start a host on another node for a grow.
- `control/host-<node>.json` (`HostStatus`): a host segment on `node`, for the campaign's
  command `seq`, leased its devices in the node's lease file and serves the agent (`ready`),
  or could not (`refused`, with the reason). The campaign tells the agent only after every
  host of the grow said `ready`.

A file that is not one (junk, another version's, the wrong shape) reads as none, warned: the
campaign waits as if nothing were written, and a grow that hears nothing in time is answered
rejected. No torch here: the campaign reads these without importing the trainer.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.files import envelope_problem, read_status_json, write_json_atomic
from training.layout import trial_files

SCHEMA = 1
MAX_BYTES = 64 << 10  # an address and a reason
HOST_STATES = ("ready", "refused")


@dataclass(frozen=True)
class AgentStore:
    endpoint: str  # host:port of the agent's store
    node: str  # the node the agent runs on
    time: float = 0.0
    schema: int = SCHEMA

    def write(self, trial_dir: str | Path) -> None:
        write_json_atomic(trial_files(trial_dir).agent_store, asdict(self))


@dataclass(frozen=True)
class HostStatus:
    seq: int  # the campaign's command the host was started for
    status: str  # one of HOST_STATES
    reason: str = ""  # why it was refused
    time: float = 0.0
    schema: int = SCHEMA

    def write(self, trial_dir: str | Path, node: str) -> None:
        write_json_atomic(trial_files(trial_dir).host_status(node), asdict(self))


def publish_agent_store(trial_dir: str | Path, endpoint: str, node: str) -> AgentStore:
    store = AgentStore(endpoint=endpoint, node=node, time=time.time())
    store.write(trial_dir)
    return store


def write_host_status(trial_dir: str | Path, node: str, seq: int, status: str, reason: str = "") -> HostStatus:
    if status not in HOST_STATES:
        raise ValueError(f"host status {status!r} is not one of {', '.join(HOST_STATES)}")
    record = HostStatus(seq=int(seq), status=status, reason=reason, time=time.time())
    record.write(trial_dir, node)
    return record


def _store_problem(raw: Any) -> str | None:
    if (wrong := envelope_problem(raw, SCHEMA, AgentStore.__dataclass_fields__)) is not None:
        return wrong
    endpoint = raw.get("endpoint")
    if not isinstance(endpoint, str) or ":" not in endpoint or not endpoint.rsplit(":", 1)[1].isdigit():
        return "endpoint is not host:port"
    if not isinstance(raw.get("node"), str):
        return "node is not a name"
    return _time_problem(raw)


def _host_problem(raw: Any) -> str | None:
    if (wrong := envelope_problem(raw, SCHEMA, HostStatus.__dataclass_fields__)) is not None:
        return wrong
    if not isinstance(raw.get("seq"), int) or isinstance(raw.get("seq"), bool) or raw["seq"] < 0:
        return "seq is not a whole number >= 0"
    if raw.get("status") not in HOST_STATES:
        return f"status is not one of {', '.join(HOST_STATES)}"
    if not isinstance(raw.get("reason", ""), str):
        return "reason is not text"
    return _time_problem(raw)


def _time_problem(raw: dict) -> str | None:
    value = raw.get("time", 0.0)
    return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "time is not a number"


def read_agent_store(trial_dir: str | Path) -> AgentStore | None:
    """Where the trial's agent listens, or None when it has not said (yet) or the file is not one (warned)."""
    raw = read_status_json(trial_files(trial_dir).agent_store, _store_problem, limit=MAX_BYTES)
    if raw is None:
        return None
    return AgentStore(endpoint=raw["endpoint"], node=raw["node"], time=float(raw.get("time", 0.0)))


def read_host_status(trial_dir: str | Path, node: str) -> HostStatus | None:
    """What the host on `node` said, or None when it has said nothing (yet) or the file is not one (warned)."""
    raw = read_status_json(trial_files(trial_dir).host_status(node), _host_problem, limit=MAX_BYTES)
    if raw is None:
        return None
    return HostStatus(seq=raw["seq"], status=raw["status"], reason=raw.get("reason", ""), time=float(raw.get("time", 0.0)))
