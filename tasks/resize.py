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

from training.files import read_json, write_json_atomic

REQUEST, RESULT = "request.json", "request-result.json"


def request_resize(trial_dir: Path, devices: int, by: str = "person") -> str:
    """Ask for a resize; `by` is "person" (a hand resize pins the size) or "policy"."""
    request_id = uuid.uuid4().hex[:12]
    write_json_atomic(Path(trial_dir) / "control" / REQUEST, {"id": request_id, "devices": devices, "by": by, "requested_at": time.time()})
    return request_id


def pending_request(trial_dir: Path, handled: set[str]) -> dict[str, Any] | None:
    """The request not yet answered, if any (answered ones stay on disk until the next)."""
    request = read_json(Path(trial_dir) / "control" / REQUEST)
    if request is None or request["id"] in handled:
        return None
    answered = read_json(Path(trial_dir) / "control" / RESULT)
    if answered is not None and answered.get("id") == request["id"]:
        return None
    return request


def answer(trial_dir: Path, request_id: str, status: str, detail: str) -> None:
    write_json_atomic(Path(trial_dir) / "control" / RESULT, {"id": request_id, "status": status, "detail": detail, "time": time.time()})


def wait_for_answer(trial_dir: Path, request_id: str, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        result = read_json(Path(trial_dir) / "control" / RESULT)
        if result is not None and result["id"] == request_id:
            return result
        time.sleep(0.1)
    return None
