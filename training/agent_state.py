"""An elastic trial agent's state (`control/state.json`): the one shape the agent writes, a
pool node's relay forwards, and the campaign, `campaign resize` and `campaign status` read.

The agent rewrites it after each command it applies: the last command's sequence number,
the generation training now, its devices and its status (running, finished, preempted,
failed). No torch here: the CLI reads it without importing the trainer. A file that is not
an agent state (junk, another version's, the wrong shape) reads as none, warned: the
agent's next write replaces it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from training.files import envelope_problem, read_status_json, write_json_atomic
from training.layout import agent_state_in

SCHEMA = 1
STATUSES = ("running", "finished", "preempted", "failed")


@dataclass(frozen=True)
class AgentState:
    seq: int  # the last command applied (its command-<seq>.json)
    gen: int  # the generation training now (-1 before the first)
    devices: tuple[str, ...]
    status: str  # one of STATUSES
    time: float = 0.0
    schema: int = SCHEMA

    def write(self, control: str | Path) -> None:
        write_json_atomic(agent_state_in(control), {**asdict(self), "devices": list(self.devices)})

    def renumbered(self, seq: int) -> "AgentState":
        """The same state under another command number (a relay's outer numbering)."""
        return replace(self, seq=seq)


def agent_state_now(seq: int, gen: int, devices: list[str], status: str) -> AgentState:
    return AgentState(seq=seq, gen=gen, devices=tuple(devices), status=status, time=time.time())


def _problem(raw: Any) -> str | None:
    if (wrong := envelope_problem(raw, SCHEMA, AgentState.__dataclass_fields__)) is not None:
        return wrong
    if not all(isinstance(raw.get(k), int) and not isinstance(raw.get(k), bool) for k in ("seq", "gen")):
        return "seq or gen is not a whole number"
    if not isinstance(raw.get("devices"), list) or not all(isinstance(d, str) for d in raw["devices"]):
        return "devices are not a list of names"
    if raw.get("status") not in STATUSES:
        return f"status {raw.get('status')!r} is not one of {', '.join(STATUSES)}"
    return None


def read_agent_state(control: str | Path) -> AgentState | None:
    """The agent's state in `control`, or None when there is none (yet) or it is not one (warned)."""
    raw = read_status_json(agent_state_in(control), _problem)
    return None if raw is None else AgentState(**{**raw, "devices": tuple(raw["devices"]), "schema": SCHEMA})
