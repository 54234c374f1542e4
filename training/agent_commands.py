"""What an elastic trial's agent is told (`control/command-<seq>.json`) and what says it did
not apply a command (`control/refused-<seq>.json`): the one shape a launcher, the campaign,
a pool node's relay and the agent write and read.

Command 0 starts the trial; each later one gives it a new set of devices (none: preempted).
The agent applies them in order, one sequence number after another. A refusal says why a
command was not applied: a pool node's lease file gave its device to another campaign (the
relay), or no device of the command is on the agent's node (the agent). No torch here: the
CLI and the campaign write commands without importing the trainer.

A command that is not one (junk, another version's, the wrong shape) is an InputError
naming the file: the agent must not skip a command it cannot read, nor guess at it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from training.files import InputError, envelope_problem, read_json, write_json_atomic
from training.layout import COMMANDS_GLOB, REFUSALS_GLOB, agent_state_in, command_in, refusal_in

SCHEMA = 1
MAX_COMMAND_BYTES = 1 << 20  # a device list with each device's environment
MODES = ("resize", "restart")  # the fast path, or the naive one kept for comparison


@dataclass(frozen=True)
class AgentCommand:
    seq: int
    devices: tuple[dict, ...]  # {"id", "env", optionally "node"} per device; () preempts
    mode: str = "resize"
    requested_at: float = 0.0
    schema: int = SCHEMA

    def write(self, control: str | Path) -> None:
        write_json_atomic(command_in(control, self.seq), self.to_json())

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "devices": [dict(d) for d in self.devices]}

    def renumbered(self, seq: int) -> "AgentCommand":
        """The same command under another number (a relay's inner numbering)."""
        return replace(self, seq=seq)

    @property
    def device_ids(self) -> list[str]:
        return [d["id"] for d in self.devices]


def _command_problem(raw: Any) -> str | None:
    if (wrong := envelope_problem(raw, SCHEMA, AgentCommand.__dataclass_fields__)) is not None:
        return wrong
    if not isinstance(raw.get("seq"), int) or isinstance(raw.get("seq"), bool) or raw["seq"] < 0:
        return "seq is not a whole number >= 0"
    devices = raw.get("devices")
    if not isinstance(devices, list) or not all(isinstance(d, dict) and isinstance(d.get("id"), str) for d in devices):
        return "devices are not a list of objects with an id"
    if not isinstance(raw.get("requested_at", 0.0), (int, float)) or raw.get("mode", "resize") not in MODES:
        return f"mode is not one of {', '.join(MODES)}, or requested_at is not a time"
    return None


def write_command(control: str | Path, seq: int, devices: list[dict], mode: str = "resize") -> AgentCommand:
    """What a launcher calls to start (seq 0) or resize a trial."""
    command = AgentCommand(seq=seq, devices=tuple(devices), mode=mode, requested_at=time.time())
    command.write(control)
    return command


def read_command(control: str | Path, seq: int) -> AgentCommand | None:
    """Command `seq`, or None when it has not been written (yet); InputError naming the file
    and what is wrong when it is not a command."""
    path = command_in(control, seq)
    raw = read_json(path, limit=MAX_COMMAND_BYTES)
    if raw is None:
        return None
    if (wrong := _command_problem(raw)) is not None:
        raise InputError(f"{path} is not a command to an elastic trial's agent ({wrong}): remove it; "
                         "`campaign resize` writes the next one")
    if raw["seq"] != seq:
        raise InputError(f"{path} holds command {raw['seq']}, not {seq}: remove it; `campaign resize` writes the next one")
    return AgentCommand(**{**raw, "devices": tuple(raw["devices"]), "schema": SCHEMA})


@dataclass(frozen=True)
class Refusal:
    seq: int
    reason: str
    time: float = 0.0
    schema: int = SCHEMA


def refuse(control: str | Path, seq: int, reason: str) -> None:
    write_json_atomic(refusal_in(control, seq), asdict(Refusal(seq=seq, reason=reason, time=time.time())))


def read_refusal(control: str | Path, seq: int) -> Refusal | None:
    """Why command `seq` was not applied, or None. A refusal that cannot be read still says the
    command was refused (its writer wrote nothing else there), with what is wrong as its reason."""
    path = refusal_in(control, seq)
    try:
        raw = read_json(path, limit=MAX_COMMAND_BYTES)
    except InputError as e:
        return Refusal(seq=seq, reason=f"refused; its reason cannot be read: {e}")
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("reason"), str):
        return Refusal(seq=seq, reason=f"refused; {path} gives no reason")
    return Refusal(seq=seq, reason=raw["reason"], time=float(raw.get("time", 0.0)))


def clear_commands(control: str | Path) -> None:
    """A new command sequence starts from nothing: no command, refusal or state of an earlier one."""
    control = Path(control)
    control.mkdir(parents=True, exist_ok=True)
    for stale in [*control.glob(COMMANDS_GLOB), *control.glob(REFUSALS_GLOB), agent_state_in(control)]:
        stale.unlink(missing_ok=True)
