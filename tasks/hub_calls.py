"""Calls the campaign's tracking process makes for it: MLflow and the pictures, out of `launch`.

MLflow's import and its SQLite store cost a process ~2 s of CPU, matplotlib ~0.5 s more; on
a small host a campaign's start and end are CPU-bound, and its metrics hub (a process of its
own, tasks/tracking_hub.py) pays the MLflow import anyway. So a function marked `@in_hub`
runs there while this process has a hub open (`use_hub`): its arguments and result travel
as JSON (paths as strings), its exception comes back as a `HubCallError` naming it. Without
a hub (a pool's campaign, `campaign profile`, a test calling the function itself) it runs
here, as before; if the hub is gone it runs here too, so a tracking call never fails for
want of the hub.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_registry: dict[str, Callable[..., Any]] = {}


class HubGone(Exception):
    """The hub process cannot take calls any more (it died, or its pipes closed)."""


class HubCallError(RuntimeError):
    """The call ran in the hub and raised: its class and message."""


class HubClient(Protocol):
    def call(self, name: str, args: list, kwargs: dict) -> Any: ...

    def call_unanswered(self, name: str, args: list, kwargs: dict | None = None) -> None: ...


_client: HubClient | None = None


def in_hub(fn: F) -> F:
    """Run `fn` in the hub when this process has one (see the module's docstring)."""
    return _routed(fn, lambda client, name, args, kwargs: client.call(name, args, kwargs))


def in_hub_unanswered(fn: F) -> F:
    """Like `in_hub`, but the caller does not wait for it: the hub runs its calls one at a
    time in the order they came, so every later call (the campaign end's drain included)
    comes after it, and the error it raises, if any, is logged when the hub's next answer is
    read. For writes that nothing in this process reads back at once (a trial's run closed,
    a sample of its system readings): the campaign's loop does not wait a store transaction
    for each. Returns None."""
    return _routed(fn, lambda client, name, args, kwargs: client.call_unanswered(name, args, kwargs), answered=False)


def _routed(fn: F, send: Callable[[HubClient, str, list, dict], Any], answered: bool = True) -> F:
    """`fn` registered under its name and sent to the hub by `send` while there is one; run
    here without a hub, or once it is gone."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    _registry[name] = fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        client = _client
        if client is not None:
            try:
                value = send(client, name, list(args), kwargs)
                return value if answered else None
            except HubGone:
                pass  # run here instead
        value = fn(*args, **kwargs)
        return value if answered else None

    return call  # type: ignore[return-value]


def use_hub(client: HubClient | None) -> None:
    """Route `@in_hub` calls of this process to `client` (None: run them here again)."""
    global _client
    _client = client


def registered(name: str) -> Callable[..., Any]:
    """The function behind a call's name, for the hub to run (KeyError if none)."""
    return _registry[name]
