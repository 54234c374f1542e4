"""Resize requests between a person (`campaign resize`) and the flow that owns the leases.

The CLI writes `<trial>/control/request.json`; the running campaign flow picks it up,
checks it, takes or gives back leases, tells the trial's agent, and answers in
`<trial>/control/request-result.json`. Files, because the two are separate processes and
the trial directory is where everything about a trial already lives.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.files import InputError, envelope_problem, read_json, read_status_json, write_json_atomic
from training.layout import trial_files

MAX_REQUEST_BYTES = 64 << 10  # a request is one line of JSON
SCHEMA = 1
BY = ("person", "policy")  # a hand resize pins the size; the policy's does not
STATUSES = ("applied", "rejected", "finished")


@dataclass(frozen=True)
class ResizeRequest:
    id: str
    devices: int  # the size asked for (0 preempts)
    by: str = "person"
    requested_at: float = 0.0
    schema: int = SCHEMA


@dataclass(frozen=True)
class ResizeAnswer:
    id: str | None  # the request's (None: a file that was not a request)
    status: str  # one of STATUSES
    detail: str
    time: float = 0.0
    schema: int = SCHEMA


def request_resize(trial_dir: Path, devices: int, by: str = "person") -> str:
    """Ask for a resize; `by` is "person" (a hand resize pins the size) or "policy"."""
    request = ResizeRequest(id=uuid.uuid4().hex[:12], devices=devices, by=by, requested_at=time.time())
    write_json_atomic(trial_files(trial_dir).resize_request, asdict(request))
    return request.id


def _request_problem(request: Any) -> str | None:
    if (wrong := envelope_problem(request, SCHEMA, ResizeRequest.__dataclass_fields__)) is not None:
        return wrong
    if not isinstance(request.get("id"), str) or not request["id"]:
        return "no string id"
    if not isinstance(request.get("devices"), int) or isinstance(request["devices"], bool) or request["devices"] < 0:
        return "devices is not a whole number >= 0"
    if request.get("by", "person") not in BY:
        return "by is neither person nor policy"
    if not isinstance(request.get("requested_at", 0.0), (int, float)) or isinstance(request.get("requested_at"), bool):
        return "requested_at is not a time"
    return None


def pending_request(trial_dir: Path, handled: set[str]) -> ResizeRequest | None:
    """The request not yet answered, if any (answered ones stay on disk until the next).

    A request.json that is not a request `campaign resize` writes (not a regular file, too
    big, not JSON, wrong fields) is moved aside to request.json.rejected and answered
    "rejected", never a reason for the running campaign to fail."""
    path = trial_files(trial_dir).resize_request
    try:
        raw = read_json(path, limit=MAX_REQUEST_BYTES)
        problem = None if raw is None else _request_problem(raw)
    except InputError as e:
        problem = str(e)
    if problem is not None:
        path.replace(path.with_name(path.name + ".rejected"))
        answer(trial_dir, None, "rejected", f"{path} is not a resize request ({problem}): use `campaign resize TRIAL N`")
        return None
    if raw is None or raw["id"] in handled:
        return None
    request = ResizeRequest(**{**raw, "schema": SCHEMA})
    answered = read_answer(trial_dir)
    if answered is not None and answered.id == request.id:
        return None
    return request


def answer(trial_dir: Path, request_id: str | None, status: str, detail: str) -> None:
    assert status in STATUSES, status
    write_json_atomic(trial_files(trial_dir).resize_answer, asdict(ResizeAnswer(id=request_id, status=status, detail=detail, time=time.time())))


def _answer_problem(raw: Any) -> str | None:
    if (wrong := envelope_problem(raw, SCHEMA, ResizeAnswer.__dataclass_fields__)) is not None:
        return wrong
    if not (raw.get("id") is None or isinstance(raw.get("id"), str)) or raw.get("status") not in STATUSES:
        return f"no id, or a status that is not one of {', '.join(STATUSES)}"
    if not isinstance(raw.get("detail"), str):
        return "no detail"
    return None


def read_answer(trial_dir: Path) -> ResizeAnswer | None:
    """The campaign's last answer, or None when there is none (yet) or it is not one (warned:
    the campaign's next answer replaces it)."""
    raw = read_status_json(trial_files(trial_dir).resize_answer, _answer_problem, limit=MAX_REQUEST_BYTES)
    return None if raw is None else ResizeAnswer(**{**raw, "schema": SCHEMA})


def wait_for_answer(trial_dir: Path, request_id: str, timeout_s: float) -> ResizeAnswer | None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        result = read_answer(trial_dir)
        if result is not None and result.id == request_id:
            return result
        time.sleep(0.1)
    return None
