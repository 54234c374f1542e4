"""Resize requests between a person (`campaign resize`) and the flow that owns the leases.

The CLI writes `<trial>/control/request.json`; the running campaign flow picks it up,
checks it, takes or gives back leases, tells the trial's agent, and answers in
`<trial>/control/request-result.json`. Files, because the two are separate processes and
the trial directory is where everything about a trial already lives.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from training.files import InputError, read_json, write_json_atomic
from training.layout import trial_files

MAX_REQUEST_BYTES = 64 << 10  # a request is one line of JSON


def request_resize(trial_dir: Path, devices: int, by: str = "person") -> str:
    """Ask for a resize; `by` is "person" (a hand resize pins the size) or "policy"."""
    request_id = uuid.uuid4().hex[:12]
    write_json_atomic(trial_files(trial_dir).resize_request, {"id": request_id, "devices": devices, "by": by, "requested_at": time.time()})
    return request_id


def _request_problem(request: Any) -> str | None:
    if not isinstance(request, dict):
        return "not a JSON object"
    if not isinstance(request.get("id"), str) or not request["id"]:
        return "no string id"
    if not isinstance(request.get("devices"), int) or isinstance(request["devices"], bool) or request["devices"] < 0:
        return "devices is not a whole number >= 0"
    if request.get("by", "person") not in ("person", "policy"):
        return "by is neither person nor policy"
    return None


def pending_request(trial_dir: Path, handled: set[str]) -> dict[str, Any] | None:
    """The request not yet answered, if any (answered ones stay on disk until the next).

    A request.json that is not a request `campaign resize` writes (not a regular file, too
    big, not JSON, wrong fields) is moved aside to request.json.rejected and answered
    "rejected", never a reason for the running campaign to fail."""
    path = trial_files(trial_dir).resize_request
    try:
        request = read_json(path, limit=MAX_REQUEST_BYTES)
        problem = None if request is None else _request_problem(request)
    except InputError as e:
        problem = str(e)
    if problem is not None:
        path.replace(path.with_name(path.name + ".rejected"))
        answer(trial_dir, None, "rejected", f"{path} is not a resize request ({problem}): use `campaign resize TRIAL N`")
        return None
    if request is None or request["id"] in handled:
        return None
    answered = read_json(trial_files(trial_dir).resize_answer, limit=MAX_REQUEST_BYTES)
    if isinstance(answered, dict) and answered.get("id") == request["id"]:
        return None
    return request


def answer(trial_dir: Path, request_id: str | None, status: str, detail: str) -> None:
    write_json_atomic(trial_files(trial_dir).resize_answer, {"id": request_id, "status": status, "detail": detail, "time": time.time()})


def wait_for_answer(trial_dir: Path, request_id: str, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        result = read_json(trial_files(trial_dir).resize_answer)
        if isinstance(result, dict) and result.get("id") == request_id:
            return result
        time.sleep(0.1)
    return None
