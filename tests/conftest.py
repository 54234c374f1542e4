"""Shared fixtures. Every test runs real parts: torchrun, Prefect, MLflow, DVC, SQLite."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# The same examples on every run: a property test that fails, fails for everyone, every
# time (a random search's rare find must not decide a CI run; HYPOTHESIS_PROFILE=explore searches anew).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

REPO = Path(__file__).resolve().parent.parent

# Before Prefect is imported anywhere: no analytics (no network), gloo on loopback.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
# Tests never touch the host-wide lease store of real campaigns.
os.environ["CAMPAIGN_LEASE_DB"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"campaign-test-leases-{os.getpid()}.db")
os.environ["CAMPAIGN_CHECKPOINT_KEY"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"campaign-test-key-{os.getpid()}")
# Workloads that passed their check are remembered per test run, not in the user's cache.
os.environ["CAMPAIGN_CHECK_CACHE"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"campaign-test-checks-{os.getpid()}")
# Subprocesses (torchrun, dvc) must find the venv's console scripts and this checkout.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


def campaign_cli(*args: str, cwd: Path | None = None):
    """The real `campaign` command in its own process (exit code, stdout, stderr).

    Not typer's in-process CliRunner: it swaps the streams, and Prefect, imported inside a
    command, would bind its log handlers to streams the runner closes afterwards.
    """
    import subprocess

    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200"})


def wait_for(check, timeout: float, what: str, every: float = 0.2):
    """`check()`'s first true value, polled until `timeout` seconds; fails naming `what`."""
    import time

    deadline = time.time() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


@pytest.fixture(scope="session", autouse=True)
def shared_prefect_server(tmp_path_factory):
    """One Prefect server per test process for the campaigns its tests launch in processes of
    their own: each launch would otherwise start one (~7 s of CPU of its ~22, and a run
    launches dozens). It is the server a launch starts (flows/warmup.py), marked as temporary
    (CAMPAIGN_PREFECT_TEMPORARY): a campaign records no API for it, as for its own. Tests of
    the launch's own server, of `campaign ui`'s and of a pool's set or unset PREFECT_API_URL
    themselves; CAMPAIGN_TEST_OWN_SERVERS=1 runs every launch with its own."""
    if os.environ.get("PREFECT_API_URL") or os.environ.get("CAMPAIGN_TEST_OWN_SERVERS"):
        yield None
        return
    from flows.warmup import WarmUp

    home = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))  # its database: this process's alone
    try:
        server = WarmUp()  # sets PREFECT_API_URL and CAMPAIGN_PREFECT_TEMPORARY
    finally:
        if home is None:
            os.environ.pop("PREFECT_HOME")
        else:
            os.environ["PREFECT_HOME"] = home
    server.ready()
    yield server.api_url
    server.stop()


@pytest.fixture(scope="session")
def digits_npz(tmp_path_factory) -> Path:
    from training.data import prepare_digits

    return prepare_digits(tmp_path_factory.mktemp("data") / "digits.npz")


def pytest_collection_modifyitems(config, items):
    """The slow end-to-end tests first: with several workers (`make test` runs three), a long
    test that starts last keeps one worker busy while the others sit idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
