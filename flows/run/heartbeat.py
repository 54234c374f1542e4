"""The campaign flow run's heartbeats to Prefect, sent by the flow instead of Prefect's engine.

A server that outlives the launch (the folder's resident one, a user's own) can tell a killed
launch's flow run crashed by its heartbeats stopping (`prefect.flow-run.heartbeat` events every
PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds, which Prefect's zombie-flow automation watches). Prefect's
engine sends them from a thread that sleeps in one-second slices and is joined at the flow's end:
every launch's end waited up to a second for it (0.55 s of the one launch profiled; from the
pictures drawn to the flow's return 0.30–0.37 s before, 0.09–0.10 s after, in launches timed). The launch turns the engine's off (`engine_heartbeats_off`)
and the flow sends the same events (`heartbeats`) from a thread that stops the moment it is told.
Where Prefect's engine still sends them (a flow run without the launch's settings), nothing is
sent twice.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Iterator

MINIMUM_S = 30  # Prefect's own floor (prefect.flow_engine.MINIMUM_HEARTBEAT_INTERVAL)

_every_s: int | None = None  # the frequency the launch took from Prefect's engine, while it runs the flow


@contextlib.contextmanager
def engine_heartbeats_off() -> Iterator[None]:
    """Prefect's settings for the flow run: no heartbeats from its engine; the frequency they
    had is kept for `heartbeats`."""
    global _every_s
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

    before, _every_s = _every_s, get_current_settings().flows.heartbeat_frequency
    try:
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield
    finally:
        _every_s = before


def _event_parts(flow_run, flow_name: str) -> tuple[dict[str, str], list]:
    """The heartbeat's resource and related resources, as Prefect's engine builds them."""
    from prefect import __version__
    from prefect.events.related import tags_as_related_resources
    from prefect.events.schemas.events import RelatedResource

    resource = {"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.name": flow_run.name or "",
                "prefect.version": __version__}
    related = [RelatedResource.model_validate({"prefect.resource.id": f"prefect.flow.{flow_run.flow_id}",
                                               "prefect.resource.role": "flow", "prefect.resource.name": flow_name})]
    if flow_run.deployment_id:
        related.append(RelatedResource.model_validate({"prefect.resource.id": f"prefect.deployment.{flow_run.deployment_id}",
                                                       "prefect.resource.role": "deployment"}))
    return resource, related + tags_as_related_resources(set(flow_run.tags or []))


@contextlib.contextmanager
def heartbeats() -> Iterator[None]:
    """In the flow: its run's heartbeats, the first at once, while the block runs, where the
    launch took them from Prefect's engine; they stop at the block's end without a wait."""
    from prefect.context import FlowRunContext
    from prefect.settings import get_current_settings

    context = FlowRunContext.get()
    if _every_s is None or get_current_settings().flows.heartbeat_frequency is not None or context is None or context.flow_run is None:
        yield  # none wanted, or Prefect's engine sends them
        return
    from prefect.events import emit_event

    every_s = max(_every_s, MINIMUM_S)
    resource, related = _event_parts(context.flow_run, context.flow.name if context.flow else "")
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                emit_event(event="prefect.flow-run.heartbeat", resource=resource, related=related)
            except Exception:  # noqa: BLE001 (a heartbeat lost is one missed beat, as in Prefect's engine)
                pass
            if stop.wait(every_s):
                return

    # The flow's context travels with it: the events worker it finds is this run's server's.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(beat,), name="flow-run-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
