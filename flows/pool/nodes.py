"""A campaign pool: nodes that each run `campaign worker`, seen through Prefect.

Prefect keeps the pool (a `process` work pool), its workers and their heartbeats; what it
does not know is what each node can run. A worker publishes that in a Prefect Variable,
`campaign-node-<pool>-<node>`: the node's address and its devices (the same `Inventory`
the packer and the policy read on one machine). A node is live while its Prefect worker's
heartbeat is fresh (`live`), so a node whose worker was killed drops out of the pool's
inventory within a few heartbeats, though its variable stays until it starts again.

The Prefect calls are the only I/O here; `live`, `pool_inventory` and the JSON form of an
inventory are pure.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable

from cluster.types import Device, Inventory, Link
from training.errors import CampaignError

NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")  # pool and node names: parts of a Prefect variable name
HEARTBEAT_S = 5  # the worker's heartbeat (Prefect's default is 30 s: a dead node would take minutes to see)
MISSED_HEARTBEATS = 3  # a node is dead after this many heartbeats did not come


class PoolError(CampaignError):
    """A pool or node name that cannot be used, or no Prefect server to hold the pool."""


def check_name(kind: str, name: str) -> str:
    if not NAME.match(name):
        raise PoolError(f"{kind} name {name!r}: use lowercase letters, digits, '-' and '_' (at most 63, "
                        f"starting with a letter or digit), e.g. --{kind} {re.sub(r'[^a-z0-9_-]+', '-', name.lower()).strip('-_') or 'node0'}")
    return name


def node_variable(pool: str, node: str) -> str:
    return f"campaign-node-{pool}-{node}"


@dataclass(frozen=True, slots=True)
class PoolNode:
    """One node of a pool as the campaign sees it."""

    name: str
    address: str
    inventory: Inventory
    live: bool
    last_heartbeat: datetime | None


# ---------------------------------------------------------------- pure parts

def inventory_to_json(inventory: Inventory) -> dict[str, Any]:
    return {
        "devices": [{"id": d.id, "node": d.node, "index": d.index, "kind": d.kind, "name": d.name,
                     "memory_bytes": d.memory_bytes} for d in inventory.devices],
        "links": [[sorted(pair), int(link)] for pair, link in inventory.links.items()],
    }


def inventory_from_json(raw: dict[str, Any]) -> Inventory:
    devices = tuple(Device(**d) for d in raw["devices"])
    links = {frozenset(pair): Link(link) for pair, link in raw.get("links", [])}
    return Inventory(devices, links)


def live(last_heartbeat: datetime | None, interval_s: float | None, now: datetime) -> bool:
    """Whether a worker that last beat at `last_heartbeat`, every `interval_s`, is still there."""
    if last_heartbeat is None:
        return False
    interval = interval_s or HEARTBEAT_S
    return (now - last_heartbeat).total_seconds() <= MISSED_HEARTBEATS * interval


def pool_inventory(nodes: Iterable[PoolNode]) -> Inventory:
    """Every live node's devices, as one inventory (device ids are unique across nodes:
    GPU UUIDs, `<node>/cpu<i>` slots)."""
    devices: list[Device] = []
    links: dict[frozenset[str], Link] = {}
    for node in nodes:
        if node.live:
            devices.extend(node.inventory.devices)
            links.update(node.inventory.links)
    return Inventory(tuple(devices), links)


# ---------------------------------------------------------------- Prefect

AWAY_POLL_S = 5.0  # how often a patient caller asks a server that does not answer again
# How long the campaign follows a trial's segments, and a segment waits to report its end,
# through a Prefect server that does not answer: a node's Prefect worker gives up after about
# 12 minutes of it (its code's backoff, not measured): its node is lost then anyway.
SERVER_PATIENCE_S = 600.0
SLOW_CALL_S = 10.0  # a call that took this long met a server away (its client retried meanwhile)
# After that, no node is judged by its heartbeats for this long: a node's Prefect worker backs
# off while the server is away (its client's retries, then longer beats) before it beats again.
NODE_GRACE_S = 120.0
_patience = threading.local()  # this thread's `server_patience`, if any
_trouble_at = -math.inf  # time.monotonic() when a call last found the server away or slow


@contextlib.contextmanager
def server_patience(seconds: float, say: Callable[[str], None], give_up: Callable[[], bool] = lambda: False):
    """Calls in this thread (`call`, `patiently`) wait out a server that does not answer, for
    up to `seconds` in all (then PoolError, as without), saying so once through `say`, and
    once it is back. For the campaign following its trials' segments: they train on meanwhile,
    and a restart of the server (a crash, its host's service restarted) is no reason to fail
    them. `give_up`: asked at each try; True ends the wait at once (a campaign that stops)."""
    _patience.limit = (seconds, say, give_up)
    try:
        yield
    finally:
        _patience.limit = None


def server_trouble_within(seconds: float) -> bool:
    """Whether a call found the server away (or waited on it) within the last `seconds`: the
    nodes' heartbeats had nowhere to go then, and their workers back off before they beat
    again, so no node is judged dead by its heartbeats until this has passed."""
    return time.monotonic() - _trouble_at < seconds


def call(coro_fn):
    """Run `coro_fn(client)` with a Prefect client, from sync code (the CLI, the campaign's
    loop, a segment's file copies); a server that does not answer is a PoolError that says so
    (within `server_patience`, once it has not answered for that long).

    The client is kept, with its connection and CSRF token, on an event loop of its own in a
    daemon thread, for as long as this process talks to the same server: a trial on the
    pool polls it several times a second, and a new client per call cost a connection and a
    token fetch before every write (each POST was two requests)."""
    import asyncio

    def once():
        client = _client_thread()
        return asyncio.run_coroutine_threadsafe(coro_fn(client.client), client.loop).result()

    return patiently(once)


def patiently(fn: Callable[[], Any]) -> Any:
    """`fn()`, a call to the Prefect server (through `call`, or Prefect's own helpers such as
    `run_deployment`), its transport errors a PoolError, waited out within `server_patience`."""
    global _trouble_at
    limit = getattr(_patience, "limit", None)
    away_since = None
    while True:
        started = time.monotonic()
        try:
            result = _said_as_pool_error(fn)
        except PoolError as e:
            now = _trouble_at = time.monotonic()
            if limit is None:
                raise
            if away_since is None:
                away_since = now
                limit[1](f"{e}; waiting for it (up to {limit[0]:.0f} s)")
            if limit[2]() or now - away_since > limit[0]:
                raise
            time.sleep(AWAY_POLL_S)  # (each try itself takes the client's own retries: about a minute)
            continue
        if time.monotonic() - started > SLOW_CALL_S:
            _trouble_at = time.monotonic()
        if away_since is not None:
            limit[1](f"the Prefect server answers again, after {time.monotonic() - away_since:.0f} s")
        return result


def server_answers() -> None:
    """Returns once the Prefect server answers (within `server_patience`, waiting for it; PoolError
    past that, or at once without)."""
    async def health(client) -> None:
        if (error := await client.api_healthcheck()) is not None:
            raise error

    call(health)


def _said_as_pool_error(fn: Callable[[], Any]) -> Any:
    import httpx

    try:
        return fn()
    except (OSError, httpx.TransportError) as e:
        raise PoolError(f"the Prefect server at {os.environ.get('PREFECT_API_URL')} does not answer ({e.__class__.__name__}: {e}): "
                        "a pool needs it running, reachable from this host and every node") from None


class _ClientThread:
    """One Prefect client, entered on an event loop that runs in a daemon thread."""

    def __init__(self, key: tuple[int, str | None, str | None]) -> None:
        import asyncio

        self.key = key
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="prefect-client", daemon=True)
        self._thread.start()
        # Made on its loop, in the thread's own (empty) context: called inside a flow run,
        # get_client() would otherwise hand back the run's client, bound to the run's loop.
        try:
            self.client = asyncio.run_coroutine_threadsafe(_entered_client(), self.loop).result()
        except BaseException:
            self._stop()  # no client (no API URL, say): no thread left behind either
            raise

    def close(self) -> None:
        import asyncio

        try:
            asyncio.run_coroutine_threadsafe(self.client.__aexit__(None, None, None), self.loop).result(timeout=10)
        except Exception:  # best effort: the server may be gone already
            pass
        self._stop()

    def _stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


_client: _ClientThread | None = None
_client_lock = threading.Lock()


def _client_thread() -> _ClientThread:
    """This process's client for the server its environment names now: a forked child, or a
    process whose PREFECT_API_URL changed since (a test's next server), gets a new one."""
    global _client
    key = (os.getpid(), os.environ.get("PREFECT_API_URL"), os.environ.get("PREFECT_API_AUTH_STRING"))
    with _client_lock:
        if _client is None or _client.key != key:
            if _client is None:
                atexit.register(_close_client)
            elif _client.key[0] == key[0]:
                _client.close()
            _client = _ClientThread(key)
        return _client


async def _entered_client():
    from prefect.client.orchestration import get_client

    client = get_client()
    await client.__aenter__()
    return client


def _close_client() -> None:
    global _client
    with _client_lock:
        if _client is not None and _client.key[0] == os.getpid():
            _client.close()
            _client = None  # a call after this one (another exit hook's) makes a new client


async def ensure_pool(client, pool: str) -> None:
    """Create the `process` work pool if it is not there yet."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        await client.read_work_pool(pool)
    except ObjectNotFound:
        try:
            await client.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                                         description="campaign pool: one `campaign worker` per node"))
        except ObjectAlreadyExists:  # another node's worker made it first
            pass


async def publish_node(client, pool: str, node: str, address: str, inventory: Inventory) -> None:
    """Write (or overwrite) this node's address and devices for the pool."""
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    name = node_variable(pool, node)
    value = {"pool": pool, "node": node, "address": address, "inventory": inventory_to_json(inventory)}
    if await client.read_variable_by_name(name) is None:
        await client.create_variable(VariableCreate(name=name, value=value, tags=["campaign-pool", pool]))
    else:
        await client.update_variable(VariableUpdate(name=name, value=value))


async def withdraw_node(client, pool: str, node: str) -> None:
    """A node leaving in order: its devices are no longer offered."""
    from prefect.exceptions import ObjectNotFound

    try:
        await client.delete_variable_by_name(node_variable(pool, node))
    except ObjectNotFound:
        pass


async def read_pool(client, pool: str, now: datetime | None = None) -> list[PoolNode]:
    """Every node that published itself in `pool`, live or not, by name."""
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

    now = now or datetime.now(timezone.utc)
    try:
        workers = {w.name: w for w in await client.read_workers_for_work_pool(pool)}
    except (ObjectNotFound, PrefectHTTPStatusError) as e:
        # Prefect 3.8 answers this call's unknown pool with a bare 404, not ObjectNotFound.
        if isinstance(e, PrefectHTTPStatusError) and e.response.status_code != 404:
            raise
        raise PoolError(f"there is no pool {pool!r} on this Prefect server: start `campaign worker --pool {pool}` on each node") from None
    prefix = node_variable(pool, "")
    nodes = []
    for variable in await client.read_variables():
        # The value names its pool: pool "a"'s prefix is also the start of pool "a-b"'s names.
        if not variable.name.startswith(prefix) or not isinstance(variable.value, dict) or variable.value.get("pool") != pool:
            continue
        value = variable.value
        worker = workers.get(value["node"])
        beat = worker.last_heartbeat_time if worker else None
        nodes.append(PoolNode(value["node"], value["address"], inventory_from_json(value["inventory"]),
                              live(beat, worker.heartbeat_interval_seconds if worker else None, now), beat))
    return sorted(nodes, key=lambda n: n.name)


SEGMENT_FLOW = "campaign-trial-segment"
SEGMENT_DEPLOYMENT = "segment"
SEGMENT_COMMAND = "python -m prefect.engine"


async def ensure_queue(client, pool: str, node: str) -> None:
    """The node's own work queue in the pool: a segment placed on a node runs there and nowhere else."""
    from prefect.exceptions import ObjectAlreadyExists

    try:
        await client.create_work_queue(name=node, work_pool_name=pool, description=f"trial segments placed on node {node}")
    except ObjectAlreadyExists:
        pass


async def ensure_segment_deployment(client, pool: str, project: str) -> str:
    """The pool's deployment of `flows/pool/segment.py:trial_segment`, run from `project` (the
    same folder on every node: shared storage); its full name for `run_deployment`."""
    flow_id = await client.create_flow_from_name(SEGMENT_FLOW)
    await client.create_deployment(
        flow_id=flow_id, name=f"{SEGMENT_DEPLOYMENT}-{pool}", work_pool_name=pool, entrypoint="flows/pool/segment.py:trial_segment",
        path=project, pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": project}}],
        # A command of its own: Prefect's process worker then starts the engine itself, not a
        # workspace supervisor that imports Prefect first and then execs the engine (six
        # segments: 12.0 CPU-s against 18.0). `python` is the node worker's interpreter
        # (flows/pool/worker.py puts it first on the PATH).
        job_variables={"command": SEGMENT_COMMAND},
        description="one trial segment on the node whose queue it is sent to (campaign launch --pool)",
    )
    return f"{SEGMENT_FLOW}/{SEGMENT_DEPLOYMENT}-{pool}"
