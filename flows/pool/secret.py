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

`campaign pool init` writes both into `.campaign/pool-<name>.json` (mode 0600) in the
project folder; every node needs the file (the project folder is shared between nodes, or
copy it). `CAMPAIGN_POOL_SECRET` names another path.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.errors import CampaignError

SECRET_ENV = "CAMPAIGN_POOL_SECRET"  # a secret file elsewhere than .campaign/pool-<name>.json
CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"
SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"
MAX_SECRET_BYTES = 4096


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
