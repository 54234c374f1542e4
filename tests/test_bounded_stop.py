"""Stopping is bounded: SIGTERM ends `campaign launch` within its bound (flows/cli.py
STOP_BOUND_S) whatever its trials left behind, and nothing of them is left running.

The trial's model starts a daemon the way some data loaders and tokenizer servers do (fork,
setsid, fork; it ignores SIGTERM and keeps every file it inherited, the warm worker's reply
pipe among them): outside the trial's process group and session, holding a pipe the
campaign reads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows.cli import STOP_BOUND_S
from tasks.trial import STOP_GRACE_S

from conftest import running_state, wait_for

DAEMON_NET = '''
import os
import signal
import time

from torch import nn


class Net(nn.Module):
    def __init__(self, pidfile, width=8):
        super().__init__()
        self.pidfile, self.calls = pidfile, 0
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))

    def forward(self, x):
        self.calls += 1
        if self.training and self.calls == 20 and not os.path.exists(self.pidfile):  # well into training
            start_daemon(self.pidfile)
        return self.body(x)


def start_daemon(pidfile):
    """fork, setsid, fork: a daemon in a session of its own that ignores SIGTERM and closes nothing."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(pidfile + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(pidfile + ".tmp", pidfile)
            while True:
                time.sleep(1)
        os._exit(0)
    os.wait()


def make(pidfile, width=8):
    return Net(pidfile, width)
'''


def test_the_stop_bound_leaves_the_trials_their_grace():
    assert STOP_GRACE_S + 3 <= STOP_BOUND_S <= 15  # the bound docs/guarantees.md states


@pytest.mark.slow
def test_sigterm_ends_the_campaign_within_its_bound_and_a_daemon_its_trial_left(tmp_path, digits_npz):
    package = tmp_path / "daemonwork"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(DAEMON_NET)
    pidfile = tmp_path / "daemon.pid"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "stray"}, "data": {"path": str(digits_npz)},
        "model": {"target": "daemonwork.nets:make", "kwargs": {"pidfile": str(pidfile)}},
        "training": {"steps": 100000, "batch_size": 16, "lr": 0.05, "checkpoint_every": 200, "eval_every": 100000},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(tmp_path / "runs"),
                     "summary": str(tmp_path / "s.json")},
    }))
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    daemon = None
    try:
        wait_for(lambda: pidfile.exists() or proc.poll() is not None, 300, "the trial's daemon")
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        daemon = int(pidfile.read_text())
        assert running_state(daemon) is not None and os.getsid(daemon) != os.getsid(proc.pid)
        proc.send_signal(signal.SIGTERM)
        told = time.monotonic()
        output = proc.communicate(timeout=120)[0]
        took = time.monotonic() - told
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if daemon is not None and running_state(daemon) is not None:
            os.kill(daemon, signal.SIGKILL)
    # The bound is kept by the process itself (a timer, then exit): what it may take beyond
    # is the kernel's delivery and the exit on a loaded host, not the campaign's work.
    assert took < STOP_BOUND_S + 5, (took, output[-4000:])
    print(f"SIGTERM to exit: {took:.1f} s")
    assert proc.returncode == 143, output[-4000:]
    wait_for(lambda: running_state(daemon) is None, 30, "the daemon to be ended")
    # The warden (flows/run/warden.py) ends whatever else the campaign left, then itself.
    left = lambda: [p for p in Path("/proc").iterdir() if p.name.isdigit() and _mentions(p, tmp_path)]  # noqa: E731
    try:
        wait_for(lambda: not left(), 60, "every process of the campaign to end")
    except AssertionError:
        raise AssertionError([(p.name, _cmdline(p)) for p in left()]) from None


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def _mentions(proc: Path, folder: Path) -> bool:
    """Whether a live process of this test's campaign is still there: its command line or
    working folder names the test's folder (metric sinks end by themselves: waited for)."""
    try:
        here = os.readlink(proc / "cwd")
    except OSError:
        here = ""
    mine = str(folder).encode() in _cmdline(proc) or here.startswith(str(folder))
    if not mine or running_state(int(proc.name)) is None:
        return False
    if b"training.metrics" in _cmdline(proc):
        return _still_after(int(proc.name), 60)
    return True


def _still_after(pid: int, seconds: float) -> bool:
    try:
        wait_for(lambda: running_state(pid) is None, seconds, f"metric sink {pid} to end")
    except AssertionError:
        return True
    return False
