"""A pool's secret: who may drive the pool's Prefect server, and which segments a node runs.

A pool node's worker runs the trial config it is handed, and a config names code to import
(`model.target`, `training.target`): anyone who can create a flow run of the pool's
deployment could run code on every node (the hole Ray clusters were attacked through,
CVE-2023-48022). Two locks close it:

- the pool's Prefect server requires its API auth string (Prefect's own basic auth:
  `PREFECT_SERVER_API_AUTH_STRING` on the server, `PREFECT_API_AUTH_STRING` on clients);
  `campaign pool server` starts it so, and every `campaign` command that uses the pool sets
  the client's from the secret;
- each segment's parameters carry an HMAC-SHA256 signature by the pool's key, and a node's
  segment flow refuses one that does not verify before it leases or runs anything.

A valid signature alone would let whoever reaches the server (with its auth string) send an
old segment again and retrain its trial, so the signature also binds a new attempt id (uuid4)
and an expiry (`signed_segment`). A node runs each attempt once (`accept_segment`): it records
every attempt id it accepted in a SQLite file next to its lease database
(`<lease db>.segments`, one write transaction per look-up and record, so two flow runs racing
with one attempt cannot both be accepted) and refuses a replayed, expired or unbound segment
before it leases anything. A segment stays valid for as long as it may wait in a node's work
queue: `CAMPAIGN_SEGMENT_VALID_S` seconds (default 3600) from its signing on the campaign's
host. A node's clock may run ahead of the campaign host's, so a segment is refused only once
the node's clock is CLOCK_SKEW_S (60 s) past its expiry; that is the only tolerance (an expiry
far ahead is the signer's choice, who holds the key). Keep the clocks in step (NTP).

`campaign pool init` writes both into `.campaign/pool-<name>.json` (mode 0600) in the
project folder; every node needs the file (the project folder is shared between nodes, or
copy it). `CAMPAIGN_POOL_SECRET` names another path.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import secrets
import sqlite3
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cluster.leases import default_path as lease_db_path
from training.errors import CampaignError

SECRET_ENV = "CAMPAIGN_POOL_SECRET"  # a secret file elsewhere than .campaign/pool-<name>.json
CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"
SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"
MAX_SECRET_BYTES = 4096
VALIDITY_ENV = "CAMPAIGN_SEGMENT_VALID_S"  # how long a signed segment may wait for its node
DEFAULT_VALIDITY_S = 3600.0
CLOCK_SKEW_S = 60.0  # a node's clock this far ahead of the campaign host's still sees a segment as unexpired
# An accepted attempt is forgotten only this long after its expiry: should a node's clock step
# back (NTP), an attempt pruned a moment ago must not look unexpired and unseen again.
PRUNE_AFTER_S = 24 * 3600.0
ATTEMPTS_BUSY_S = 30.0  # how long a flow run waits for another's write transaction on the attempts file
_ATTEMPT_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex


class PoolSecretError(CampaignError):
    """The pool's secret is missing, unreadable, too open, or a segment's signature is wrong."""


@dataclass(frozen=True)
class PoolSecret:
    pool: str
    auth_string: str  # "campaign:<token>": Prefect's basic auth (user:password)
    key: bytes  # signs segment parameters
    path: Path


def secret_path(pool: str, root: Path | None = None) -> Path:
    if os.environ.get(SECRET_ENV):
        return Path(os.environ[SECRET_ENV])
    return (root or Path.cwd()) / ".campaign" / f"pool-{pool}.json"


def init_secret(pool: str, root: Path | None = None, force: bool = False) -> Path:
    """Write a new secret for `pool` (0600, created so: never readable by others, not even for a
    moment); an existing one is kept unless `force` (then every node needs the new file)."""
    path = secret_path(pool, root)
    if path.exists() and not force:
        raise PoolSecretError(f"{path} exists: pool {pool} has its secret already (give --force to replace it; every node and "
                              "the server then need the new one)")
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"pool": pool, "auth_string": f"campaign:{secrets.token_urlsafe(32)}", "key": secrets.token_hex(32)})
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def missing_secret_fix(pool: str, path: Path) -> str:
    return (f"pool {pool} has no secret at {path}: run `campaign pool init --pool {pool}` on the head node, start its server with "
            f"`campaign pool server --pool {pool} --host ADDRESS`, and give every node the file (mode 0600; or point "
            f"{SECRET_ENV} at it)")


def load_secret(pool: str, root: Path | None = None) -> PoolSecret:
    """The pool's secret, or a PoolSecretError that says how to make or fix it."""
    path = secret_path(pool, root)
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise PoolSecretError(missing_secret_fix(pool, path)) from None
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_SECRET_BYTES:
        raise PoolSecretError(f"{path}: not a pool secret (a regular file of a few hundred bytes); {missing_secret_fix(pool, path)}")
    if info.st_mode & 0o077:
        raise PoolSecretError(f"{path} is readable by other users (mode {stat.S_IMODE(info.st_mode):o}): `chmod 600 {path}`")
    try:
        raw = json.loads(path.read_text())
        secret = PoolSecret(pool, str(raw["auth_string"]), bytes.fromhex(raw["key"]), path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PoolSecretError(f"{path} is not a pool secret ({e.__class__.__name__}: {e}); {missing_secret_fix(pool, path)}") from None
    if raw.get("pool") != pool:
        raise PoolSecretError(f"{path} is the secret of pool {raw.get('pool')!r}, not {pool!r}")
    if ":" not in secret.auth_string or len(secret.key) < 16:
        raise PoolSecretError(f"{path}: its auth string or key is malformed; {missing_secret_fix(pool, path)}")
    return secret


def use_secret(pool: str) -> PoolSecret:
    """Load the pool's secret and make this process (and what it starts) a client of the
    pool's server with it. Call before Prefect reads its settings."""
    secret = load_secret(pool)
    os.environ[CLIENT_AUTH_ENV] = secret.auth_string
    os.environ[SECRET_ENV] = str(secret.path.resolve())  # a worker's flow runs verify with the same file
    return secret


def _canonical(payload: dict[str, Any]) -> bytes:
    # JSON as Prefect hands parameters back (tuples become lists), keys sorted: the same bytes on both sides.
    return json.dumps(json.loads(json.dumps(payload, default=str)), sort_keys=True, separators=(",", ":")).encode()


def sign(secret: PoolSecret, payload: dict[str, Any]) -> str:
    return hmac.new(secret.key, _canonical(payload), hashlib.sha256).hexdigest()


def verify(secret: PoolSecret, payload: dict[str, Any], signature: str | None) -> None:
    """Raise PoolSecretError unless `signature` is the pool key's for `payload`."""
    if not signature:
        raise PoolSecretError(f"an unsigned segment was sent to pool {secret.pool}: refused (only a campaign holding the pool's "
                              "key may place trials on its nodes)")
    if not hmac.compare_digest(sign(secret, payload), str(signature)):
        raise PoolSecretError(f"a segment whose signature does not verify with pool {secret.pool}'s key was refused (a campaign "
                              "with another key, or parameters changed on the way)")


POOL_ENV = "CAMPAIGN_POOL"  # set by `campaign worker` for its flow runs: the pool whose key they verify with


def node_secret() -> PoolSecret:
    """The secret a node's segment verifies with: its worker's pool and secret file, never
    anything the segment's parameters say."""
    pool = os.environ.get(POOL_ENV)
    if not pool or not os.environ.get(SECRET_ENV):
        raise PoolSecretError("this process was not started by a pool node's `campaign worker` with the pool's secret: "
                              "no segment runs here")
    return load_secret(pool)


def segment_validity_s() -> float:
    """Seconds a segment stays valid after it is signed: `CAMPAIGN_SEGMENT_VALID_S`, else an hour."""
    raw = os.environ.get(VALIDITY_ENV)
    if not raw:
        return DEFAULT_VALIDITY_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise PoolSecretError(f"{VALIDITY_ENV}={raw!r}: give the seconds a signed segment may wait for its node (a number > 0)")
    return value


def signed_segment(secret: PoolSecret, params: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """`params` bound to a new attempt id and an expiry, all signed: the parameters a campaign
    sends a node. Each send is a new attempt (a segment sent again to a node that came back too),
    so a node can refuse the same one twice. `now`: the signing time (default: this clock's)."""
    if bound_keys := {"attempt_id", "expires_at", "signature"} & params.keys():
        raise ValueError(f"a segment's parameters may not carry {sorted(bound_keys)}: signed_segment adds them")
    issued = time.time() if now is None else now
    bound = {**params, "attempt_id": uuid.uuid4().hex, "expires_at": issued + segment_validity_s()}
    return {**bound, "signature": sign(secret, bound)}


def accept_segment(secret: PoolSecret, payload: dict[str, Any], signature: str | None, node: str,
                   now: float | None = None) -> None:
    """Raise PoolSecretError unless this node may run the segment `payload` (its parameters
    but the signature): signed by the pool's key, bound to an attempt and an expiry, not
    expired, and its attempt never accepted here before; then it is recorded as accepted.
    The signature is checked first: a forgery must not be able to use up attempt ids."""
    verify(secret, payload, signature)
    attempt_id, expires_at = _binding(payload)
    trial = str((payload.get("config") or {}).get("trial_id", "?"))
    now = time.time() if now is None else now
    if expired(expires_at, now):
        raise PoolSecretError(f"attempt {attempt_id} of trial {trial} expired at {_when(expires_at)} (node {node}'s clock: "
                              f"{_when(now)}, {CLOCK_SKEW_S:.0f} s allowed for clock skew): refused; the campaign sends "
                              "the trial again if it still wants it")
    record_attempt(attempts_path(), attempt_id, trial, node, expires_at, now)


def expired(expires_at: float, now: float) -> bool:
    """Whether a segment expiring at `expires_at` (the campaign host's clock) is past it at `now`
    (this node's), allowing CLOCK_SKEW_S for a node clock that runs ahead."""
    return now > expires_at + CLOCK_SKEW_S


def _binding(payload: dict[str, Any]) -> tuple[str, float]:
    """The attempt id and expiry a verified segment is bound to; refused if it has none (signed
    by a campaign older than replay protection, which any holder of the auth string could replay)."""
    attempt_id, expires_at = payload.get("attempt_id"), payload.get("expires_at")
    if attempt_id is None or expires_at is None:
        raise PoolSecretError("a segment signed without an attempt id and expiry was refused: it could be sent again and "
                              "again (a campaign whose code predates replay protection: update it on the campaign's host)")
    if not isinstance(attempt_id, str) or not _ATTEMPT_ID.fullmatch(attempt_id):
        raise PoolSecretError(f"a segment's attempt id {attempt_id!r} is not a uuid4 in hex: refused")
    try:
        expires = float(expires_at)
    except (TypeError, ValueError):
        expires = math.nan
    if not math.isfinite(expires):
        raise PoolSecretError(f"a segment's expiry {expires_at!r} is not a time: refused")
    return attempt_id, expires


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def attempts_path() -> Path:
    """The node's record of accepted attempts: beside its lease database, wherever that is now
    (read at each call: `CAMPAIGN_LEASE_DB` or the lease store's default)."""
    lease_db = lease_db_path()
    return lease_db.with_name(lease_db.name + ".segments")


_ATTEMPTS_TABLE = ("CREATE TABLE IF NOT EXISTS accepted_attempts (attempt_id TEXT NOT NULL PRIMARY KEY, trial TEXT NOT NULL,"
                   " node TEXT NOT NULL, accepted_at REAL NOT NULL, expires_at REAL NOT NULL) STRICT")


def record_attempt(path: Path, attempt_id: str, trial: str, node: str, expires_at: float, now: float) -> None:
    """Record that this node accepted `attempt_id`, or raise PoolSecretError if it did before.
    One write transaction (BEGIN IMMEDIATE: the file's one write lock, across processes) spans
    the look-up and the insert, so of two flow runs racing with one attempt exactly one wins."""
    with _attempts_db(path) as conn:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(_ATTEMPTS_TABLE)
            conn.execute("DELETE FROM accepted_attempts WHERE expires_at < ?", (now - CLOCK_SKEW_S - PRUNE_AFTER_S,))
            earlier = conn.execute("SELECT trial, node, accepted_at FROM accepted_attempts WHERE attempt_id = ?",
                                   (attempt_id,)).fetchone()
            if earlier is None:
                conn.execute("INSERT INTO accepted_attempts VALUES (?, ?, ?, ?, ?)", (attempt_id, trial, node, now, expires_at))
            conn.execute("COMMIT")
        except BaseException:
            with suppress(sqlite3.Error):  # the error that ended the transaction is the one to report
                conn.execute("ROLLBACK")
            raise
    if earlier is not None:
        earlier_trial, earlier_node, accepted_at = earlier
        raise PoolSecretError(f"attempt {attempt_id} of trial {earlier_trial} was already run on node {earlier_node} at "
                              f"{_when(accepted_at)}: a replay is refused")


@contextmanager
def _attempts_db(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection to the attempts file in WAL mode. Any failure to use it refuses the segment
    (a node that cannot tell whether it ran an attempt must not run it), saying where and why."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=ATTEMPTS_BUSY_S, isolation_level=None)
    except (OSError, sqlite3.Error) as e:
        raise PoolSecretError(_attempts_unusable(path, e)) from None
    try:
        conn.execute("PRAGMA synchronous = FULL")  # an accepted attempt survives a crash of the node
        _use_wal(conn)
        yield conn
    except sqlite3.Error as e:
        raise PoolSecretError(_attempts_unusable(path, e)) from None
    finally:
        conn.close()


def _use_wal(conn: sqlite3.Connection) -> None:
    """Put a new attempts file in WAL mode (readers never wait for a writer). The switch needs
    the file to itself and, unlike a transaction, does not wait for another connection (SQLite
    asks no busy handler): flow runs that open a new file together try again until it is done."""
    deadline = time.monotonic() + ATTEMPTS_BUSY_S
    while conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
        try:
            conn.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as e:
            if e.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _attempts_unusable(path: Path, error: Exception) -> str:
    return (f"this node's record of accepted segments {path} cannot be used ({error.__class__.__name__}: {error}): no segment "
            "runs until it can (moved aside, a new one is started, and segments signed before then could be sent again "
            "until they expire)")
