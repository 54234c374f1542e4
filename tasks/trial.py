"""Run one trial segment: plan the torchrun launch on the leased devices, then apply it.

The plan (command, environment, files) is pure data a test can assert on; applying it
starts torchrun in its own process group, waits, and turns a failure into an error whose
first line says why in the user's terms (what its processes recorded: training/failure.py;
a signal by name, an out-of-memory kill told by its cgroup), retried only when it is an
infrastructure failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from prefect import task

from cluster.inventory import visible_devices_env
from cluster.types import Device
from tasks import timings
from tasks.records import TrialRecord, completed_result, read_trial_record, update_record
from tasks.trial_log import LogForwarder
from tasks.watchdog import Watchdog, queued_again, trial_processes
from training.config import TrialConfig
from training.agent_commands import clear_commands, write_command
from training.errors import CampaignError
from training.failure import DISK_FULL, SIGNAL, USER, Failure, clear_failure, exit_description, read_failure, signal_name
from training.fence import launched_again, lease_problem
from training.files import DiskFull, private_temp_dir, size_text, write_atomic
from training.manifest import TMP_PREFIX
from training.loopback import BIND_ENV
from training.process import (die_with_parent, end_processes, processes_marked, signal_group, signal_process,
                              stop_process_groups)
from training.zygote import Zygote, ZygoteGone
from training.launch import launch_env
from training.layout import of_node, trial_files

LOG_TAIL_CHARS = 3000

log = logging.getLogger(__name__)


class TrialFailed(CampaignError):
    """The trial's processes failed. The message's first line says why in one line (what the
    live view and `campaign status` show); an infrastructure failure's goes on with the end of
    the trial's log."""

    @property
    def summary(self) -> str:
        return str(self).split("\n", 1)[0]


class TrialStopped(TrialFailed):
    """The campaign stopped the trial (SIGTERM, an error of its own): not the trial's fault."""


class NotRetried(TrialFailed):
    """A failure a retry would only repeat: run_trial's retry condition lets it be."""


class TrialStalled(NotRetried):
    """The trial's step stood still past training.stall_timeout_s (tasks/watchdog.py): its
    stacks are in its log, it was stopped, and it is not retried (it would hang again)."""


class TrialRaised(NotRetried):
    """An exception raised in the user's own code (training.failure: model, data, loss,
    optimizer, training function): it would be raised again after as many steps."""


class TrialDiskFull(NotRetried):
    """A write of the trial found no room (ENOSPC, EDQUOT): it would fill the disk again."""


PREEMPTED = 3  # the elastic agent's exit code when the trial was resized to zero devices
# SIGTERM, then this long for a trial's processes to go, then SIGKILL: within the bound that
# `campaign launch` keeps on its own stop (flows/cli.py STOP_BOUND_S). A trial loses nothing by
# it: it resumes from its last checkpoint.
STOP_GRACE_S = 10.0
STRAY_GRACE_S = 2.0  # the same for what a trial left outside its process group (daemons)

# Every process a trial starts carries this mark in its environment, and so do their
# descendants, daemons that left the trial's process group and session included: the
# campaign ends them all when it stops (`stop_launched_trials`), whatever they hold.
TRIAL_MARK = "CAMPAIGN_TRIAL_MARK"
_trial_mark = secrets.token_hex(8)

# Process groups of the trials this process has launched and not yet seen exit: the flow
# stops them before it gives their devices back (no device to two trials, even on a crash).
_live_groups: dict[int, str] = {}
_live_lock = threading.Lock()
_stopped = threading.Event()  # set by stop_launched_trials: a task's retry must not launch afterwards
_revoked: set[str] = set()  # trials whose leases were lost: not launched again until readmitted


def accept_launches() -> None:
    """A campaign flow starts: launches are allowed (again) in this process."""
    _stopped.clear()
    with _live_lock:
        _ended.clear()


def campaign_stopping(trial_id: str) -> bool:
    """Whether a segment of `trial_id` must not run on: the campaign stops, or its leases were lost."""
    return _stopped.is_set() or trial_id in _revoked


def stop_launched_trials(grace_s: float = STOP_GRACE_S) -> list[str]:
    """Stop every trial this process launched that is still running; returns their ids.
    Returns only when their process groups are gone (or were killed)."""
    with _live_lock:
        _stopped.set()
        _drop_tickets()  # no worker starts a staged trial from now on
        groups = dict(_live_groups)
    stop_process_groups(list(groups), grace_s)
    end_processes(left_behind(), STRAY_GRACE_S)
    return list(groups.values())


def left_behind() -> list[int]:
    """Processes of this campaign's trials still running outside the trials' process groups
    (a daemon a trial forked, in a session of its own), but the warm workers' zygote and idle
    workers (ended in order by close_warm_workers) and metric sinks (they end by themselves
    once they have sent what they hold)."""
    with _live_lock:
        kept = {w.proc.pid for workers in _idle_workers.values() for w in workers}
    with _zygotes_lock:
        kept |= {z.proc.pid for z in _zygotes.values()}
    return [pid for pid, cmd in processes_marked(TRIAL_MARK, _trial_mark).items()
            if pid not in kept and b"training.metrics" not in cmd]


def kill_every_trial_process() -> None:
    """SIGKILL, now, every process of this campaign's trials (a stop that ran out of time)."""
    with _live_lock:
        _stopped.set()
        _drop_tickets()
        groups = list(_live_groups)
    for pgid in groups:
        signal_group(pgid, signal.SIGKILL)
    for pid in processes_marked(TRIAL_MARK, _trial_mark):
        signal_process(pid, signal.SIGKILL)


def revoke(trial_id: str, grace_s: float = STOP_GRACE_S) -> bool:
    """The trial's leases are lost (reclaimed, maybe given to another campaign): stop its
    processes now and refuse to launch it again until `readmit`. True if it was running."""
    with _live_lock:
        _revoked.add(trial_id)
        groups = [pgid for pgid, owner in _live_groups.items() if owner == trial_id]
    stop_process_groups(groups, grace_s)
    return bool(groups)


def trial_process_groups(trial_id: str) -> list[int]:
    """The process groups (their leaders' pids) this process runs the trial in now."""
    with _live_lock:
        return [pgid for pgid, owner in _live_groups.items() if owner == trial_id]


def readmit(trial_id: str) -> bool:
    """The campaign has taken note of the revocation (it queues the trial again); True if it was revoked."""
    with _live_lock:
        was = trial_id in _revoked
        _revoked.discard(trial_id)
    return was


@dataclass(frozen=True)
class LaunchPlan:
    command: list[str]
    env: dict[str, str]  # added to the parent's environment
    cwd: Path
    config_path: Path
    log_path: Path
    # Elastic trials: the agent's first command, one entry per worker: its device and env.
    workers: tuple[dict, ...] = ()
    warm: bool = False  # a one-device trial run by a warm worker (command starts one if none is idle)
    control: Path | None = None  # elastic trials: the agent's command folder

    @property
    def elastic(self) -> bool:
        return bool(self.workers)


def control_dir(config: TrialConfig) -> Path:
    return trial_files(config.trial_dir).control


def plan_launch(config: TrialConfig, devices: Sequence[Device], cwd: Path, python: str = sys.executable, elastic: bool = False,
                warm: bool = False, control: Path | None = None) -> LaunchPlan:
    """torchrun for a fixed-size trial; the elastic agent (one worker per device) for an
    elastic one, reading its commands from `control` (default: the trial's control folder,
    where the campaign writes them); a warm worker for a one-device trial when `warm`."""
    trial_dir = Path(config.trial_dir)
    if warm and not elastic and len(devices) == 1:
        command, env = _warm_command(devices[0], python)
        return LaunchPlan(command, env, cwd, trial_files(trial_dir).config, trial_files(trial_dir).log, warm=True)
    if elastic:
        workers = tuple({"id": d.id, "env": visible_devices_env([d])} for d in devices)
        control = control or control_dir(config)
        command = [python, "-m", "training.elastic", "--config", str(trial_files(trial_dir).config), "--control", str(control)]
        return LaunchPlan(command, launch_env(), cwd, trial_files(trial_dir).config, trial_files(trial_dir).log, workers, control=control)
    env = {**visible_devices_env(devices), **launch_env()}
    command = [
        python, "-m", "training.launch",  # torchrun, its stores on loopback only
        "--standalone",  # a single-node rendezvous on a free port: trials never collide
        f"--nproc-per-node={len(devices)}",
        "-m", "training.train", "--config", str(trial_files(trial_dir).config),
    ]
    return LaunchPlan(command, env, cwd, trial_files(trial_dir).config, trial_files(trial_dir).log)


@dataclass(frozen=True)
class NodeRole:
    """One node's part in a trial that spans nodes (torchrun's c10d rendezvous)."""

    nnodes: int
    host: bool  # this node hosts the rendezvous store (at `endpoint`)
    endpoint: str  # "address:port" of the rendezvous store, on the host node
    address: str  # this node's own address: its stores and its workers listen there only
    interface: str  # the network interface with that address (gloo's transport)
    # Elastic across nodes: the trial goes on with as few as `min_nodes` nodes when one is
    # lost, and takes a node back when it returns (None: all `nnodes` or none).
    min_nodes: int | None = None


# Elastic across nodes (torch's elastic agent, `--nnodes=min:max`): a node lost is seen when
# its agent misses its rendezvous heartbeats; the round then closes with the nodes left after
# LAST_CALL_S, and the workers restart from the trial's last checkpoint (a reproducible trial's
# result does not depend on the world size: training/trainer.py's logical ranks).
# LAST_CALL_S is also how long the first node waits for the others at the start: a node that
# comes later is taken in by a restart (correct, but it costs the steps done meanwhile).
NODE_HEARTBEAT_S, NODE_KEEP_ALIVE_S, LAST_CALL_S = 3, 1, 5
NODE_RESTARTS = 3  # node losses (or worker failures) a trial rides through before it fails


def plan_node_launch(config: TrialConfig, devices: Sequence[Device], cwd: Path, role: NodeRole,
                     python: str = sys.executable, node: str | None = None) -> LaunchPlan:
    """This node's torchrun for a trial over `role.nnodes` nodes, `devices` of them here.

    Every node runs the same command with its own address: the c10d rendezvous gathers them
    (ranks by arrival; a trial's result does not depend on which rank is where, see
    training/trainer.py), the store is on the host node, and nothing listens on any other
    address than the node's own (or its loopback). With `role.min_nodes` the trial is elastic
    across nodes: a node lost is left behind (the others restart from the last checkpoint
    without it) and a node that starts the same command later is taken in (the agents see it
    waiting and restart the workers with it). The host node's loss ends the trial: it holds
    the rendezvous store.

    `node`: this node's name, when it is not the host: its config and log are its own
    (`trial-<node>.json`, `train-<node>.log`; the host's are the trial's). Each node's config
    names its own lease, which its workers watch: in a folder the nodes share, one file for
    all would give some node's workers another node's lease, and fence them when that node
    is lost.
    """
    trial_dir = Path(config.trial_dir)
    files = trial_files(trial_dir)
    config_path, log_path = files.config, files.log
    if node is not None and not role.host:
        config_path, log_path = of_node(config_path, node), of_node(log_path, node)
    env = {**visible_devices_env(devices), **launch_env(), "GLOO_SOCKET_IFNAME": role.interface, "MASTER_ADDR": role.address,
           BIND_ENV: role.address}
    # Which node hosts the store is said, not guessed from host names (which name the machine, not the node's address).
    rendezvous_conf = f"is_host={int(role.host)}"
    nodes = [f"--nnodes={role.nnodes}"]
    if role.min_nodes is not None:
        nodes = [f"--nnodes={role.min_nodes}:{role.nnodes}", f"--max-restarts={NODE_RESTARTS}"]
        rendezvous_conf += f",last_call_timeout={LAST_CALL_S},heartbeat={NODE_HEARTBEAT_S},keep_alive_interval={NODE_KEEP_ALIVE_S}"
        # torch 2.13: a rank 0 that shares its rendezvous store keeps the bootstrap address of
        # its first round, so a node that joins later waits for a key nobody writes (found in
        # tests/test_multinode.py); without sharing, every round publishes it.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    command = [
        python, "-m", "training.launch", *nodes, f"--nproc-per-node={len(devices)}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={role.endpoint}", f"--rdzv-id={config.trial_id}",
        f"--rdzv-conf={rendezvous_conf}", f"--local-addr={role.address}",
        "-m", "training.train", "--config", str(config_path),
    ]
    return LaunchPlan(command, env, cwd, config_path, log_path)


WORKER_MODULE = "tasks.warm_worker"  # training.worker, passing its device on to the trial staged after its own


def _warm_command(device: Device, python: str) -> tuple[list[str], dict[str, str]]:
    """A warm worker's command and the env that binds it to `device`."""
    return [python, "-m", WORKER_MODULE], {**visible_devices_env([device]), **launch_env()}


def _torchrun_dies_with_campaign() -> None:
    # SIGTERM lets torchrun stop its workers; they also die with torchrun (training/train.py).
    die_with_parent(signal.SIGTERM)


_zygotes: dict[tuple[str, str], Zygote] = {}
_zygotes_lock = threading.Lock()


def _zygote_for(python: str, cwd: Path) -> Zygote:
    """The campaign's zygote of warm workers for this interpreter and folder (training/zygote.py),
    started at the first call: torch and the trainer imported once, not once per worker. One
    that exited is not started again: its workers are started on their own (ZygoteGone)."""
    with _zygotes_lock:
        key = (python, str(cwd))
        if key not in _zygotes:
            _zygotes[key] = Zygote([WORKER_MODULE], cwd, {**os.environ, **launch_env(), TRIAL_MARK: _trial_mark}, python,
                                   new_session=True)
        return _zygotes[key]


def adopt_zygote(python: str, cwd: Path, take: Callable[[dict[str, str]], Zygote | None]) -> bool:
    """Make the campaign's zygote for this interpreter and folder one that `take` gives (the
    resident server's spare: tasks/spares.py), given the environment this module would start
    one with; False if the campaign has one already or `take` gives none."""
    with _zygotes_lock:
        key = (python, str(cwd))
        if key in _zygotes:
            return False
        zygote = take({**os.environ, **launch_env(), TRIAL_MARK: _trial_mark})
        if zygote is None:
            return False
        _zygotes[key] = zygote
        return True


def _reply_reader(fd: int):
    """The campaign's end of a worker's reply pipe: unbuffered (see WarmWorker._reply)."""
    return os.fdopen(fd, "rb", buffering=0)


class WarmWorker:
    """A `training.worker` process (tasks/warm_worker.py): trials are sent to it one at a time
    (see that module). Forked by the campaign's zygote; started on its own if the zygote cannot fork."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path):
        self.key = _key(command, env, cwd)
        self.reply: dict = {}  # the worker's last answer (wait)
        self._unread = b""  # what was read of its replies past the last whole line
        self.plan_env = env
        self.env = {**os.environ, **env}  # what the process was started with
        try:
            self.replies = self._fork(_zygote_for(command[0], cwd), cwd)
            return
        except ZygoteGone:
            pass
        reply_read, reply_write = os.pipe()
        self.proc = subprocess.Popen(
            [*command, "--reply-fd", str(reply_write)], cwd=cwd, env={**self.env, TRIAL_MARK: _trial_mark},
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(reply_write,),
            start_new_session=True, preexec_fn=_torchrun_dies_with_campaign, text=True,
        )
        os.close(reply_write)
        self.replies = _reply_reader(reply_read)

    def _fork(self, zygote: Zygote, cwd: Path):
        """This worker forked by the zygote: its stdin and reply pipes passed to it; the
        reading end of the replies."""
        stdin_read, stdin_write = os.pipe()
        reply_read, reply_write = os.pipe()
        try:
            self.proc = zygote.fork(WORKER_MODULE, ["--reply-fd", "{fd1}"], self.env, cwd, fds=[stdin_read, reply_write], stdin=True,
                                    name="warm worker")
        except BaseException:
            os.close(stdin_write)
            os.close(reply_read)
            raise
        finally:
            os.close(stdin_read)
            os.close(reply_write)
        self.proc.stdin = os.fdopen(stdin_write, "w")
        return _reply_reader(reply_read)

    def run(self, plan: LaunchPlan, trial_id: str) -> int:
        """The trial's exit code: 0, 1 (it raised), or the worker's own if it died (killed: negative)."""
        return self.wait() if self.send(plan, trial_id) else self.wait(sent=False)

    def send(self, plan: LaunchPlan, trial_id: str) -> bool:
        """Give the worker its next trial (it starts at once: it serves one at a time); False
        if the worker is gone. The worker starts the trial staged after it, if any, from its
        ticket (tasks/warm_worker.py)."""
        # The trial sees the campaign's environment of now, as a new process would: a worker
        # started before the campaign's loop (prestart_warm_workers) learns its metrics hub here.
        now = {**os.environ, **self.plan_env}
        changed = {k: v for k, v in now.items() if self.env.get(k) != v}
        request = {"config": str(plan.config_path), "log": str(plan.log_path), "env": changed, "unset": sorted(set(self.env) - set(now)),
                   "next": str(_ticket_path(trial_id))}
        self.env = now
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def wait(self, sent: bool = True) -> int:
        """The exit code of the trial sent last (see run)."""
        try:
            line = self._reply() if sent else ""
        except (OSError, ValueError):
            line = ""
        if line:
            self.reply = json.loads(line)
            return int(self.reply["code"])
        self.reply = {}
        self.close()
        return self.proc.returncode if self.proc.returncode is not None else 1

    def _reply(self, every_s: float = 0.2) -> str:
        """The worker's next answer line, or "" once the worker has exited without one. Never a
        wait on the pipe alone: a process its trial left behind (a daemon: fork + setsid)
        inherits the pipe's writing end and may hold it for good, so that the end of the file
        never comes. Read unbuffered, by hand: a worker that started the next trial itself
        (tasks/warm_worker.py) may have answered for both by the time the first answer is read,
        and the second must be found here, not in a file object's buffer that select cannot see."""
        while b"\n" not in self._unread:
            if select.select([self.replies], [], [], every_s)[0]:
                chunk = self.replies.read(65536)
                if not chunk:  # the end of the file: it exited
                    break
                self._unread += chunk
            elif self.proc.poll() is not None and not select.select([self.replies], [], [], 0)[0]:
                break  # it exited, and what it wrote before is all read
        line, newline, rest = self._unread.partition(b"\n")
        self._unread = rest if newline else b""
        return line.decode() if newline else ""

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def discard(self) -> None:
        """A worker whose trial failed or was stopped: not reused."""
        if self.alive:
            self.proc.kill()
        self.close()

    def end_input(self) -> None:
        """No more trials: the worker exits once it has read to the end."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def close(self) -> None:
        self.end_input()
        try:
            # Its exit waits until its trials' metrics are in MLflow (training.metrics.close_shared_sink):
            # as long as that may take, so that a campaign reads MLflow only once they are there.
            self.proc.wait(timeout=70)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.replies.close()


def warm_key(plan: LaunchPlan) -> str:
    return _key(plan.command, plan.env, plan.cwd)


def _key(command: list[str], env: dict[str, str], cwd: Path) -> str:
    """Workers are interchangeable when they see the same device, environment and directory."""
    return json.dumps([sorted(env.items()), str(cwd), command], sort_keys=True)


_idle_workers: dict[str, list[WarmWorker]] = {}


def prestart_warm_workers(devices: Sequence[Device], cwd: Path, python: str = sys.executable) -> None:
    """Start the zygote the first one-device trials' warm workers will be forked from (where
    `devices`, their devices, are not empty): it imports torch and the trainer (seconds)
    while the campaign itself starts, and forks each worker when its trial comes, under that
    trial's lease (training.worker). One import, however many devices."""
    if devices:
        _zygote_for(python, cwd)


def close_warm_workers() -> None:
    """End the idle warm workers (the campaign is done; busy ones are stopped with their trials)."""
    with _live_lock:
        idle = [w for workers in _idle_workers.values() for w in workers]
        _idle_workers.clear()
    for worker in idle:  # told all at once, they wind down (process group, metric sink) side by side
        worker.end_input()
    for worker in idle:
        worker.close()
    with _zygotes_lock:
        zygotes = list(_zygotes.values())
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()
    global _tickets
    with _live_lock:
        tickets, _tickets = _tickets, None
    if tickets is not None:
        shutil.rmtree(tickets, ignore_errors=True)


def _refuse_if_stopping(config: TrialConfig, refused: str = "not launched") -> None:
    """TrialStopped, saying `refused` and why, once the campaign stops or the trial's leases
    are lost: nothing of the trial starts then (called under _live_lock)."""
    if _stopped.is_set():
        raise TrialStopped(f"trial {config.trial_id}: {refused}, the campaign is stopping (its devices are being released)")
    if config.trial_id in _revoked:
        raise TrialStopped(f"trial {config.trial_id}: {refused}, its leases were lost")


def _take_idle(key: str) -> WarmWorker | None:
    """An idle live worker for `key`, taken off the idle list (called under _live_lock)."""
    idle = [w for w in _idle_workers.get(key, []) if w.alive]
    worker = idle.pop() if idle else None
    _idle_workers[key] = idle
    return worker


def _run_warm(plan: LaunchPlan, config: TrialConfig) -> int:
    with _live_lock:
        handed = _handed.pop(config.trial_id, None)
        if handed is None:
            _refuse_if_stopping(config)
    if handed is not None:  # already running: the worker of the trial before it started it (hand_over)
        handed.done.wait()
        return handed.code
    with _live_lock:
        worker = _take_idle(warm_key(plan))
    if worker is None:  # outside the lock: a fork waits for the zygote's imports (seconds, at a campaign's start)
        worker = WarmWorker(plan.command, plan.env, plan.cwd)
    with _live_lock:
        try:
            _refuse_if_stopping(config)  # a stop that came while the worker was made finds no group of it to stop
        except TrialStopped:
            worker.discard()
            raise
        _live_groups[worker.proc.pid] = config.trial_id  # its own session: the group id is its pid
    code = None
    try:
        code = worker.run(plan, config.trial_id)
        return code
    finally:
        _after_trial(worker, config, code)


def _after_trial(worker: WarmWorker, config: TrialConfig, code: int | None) -> None:
    """The worker's trial ended (`code`; None: this thread was interrupted): the worker has
    started the trial staged after it (its ticket: tasks/warm_worker.py), starts it now (the
    ticket was written after the worker looked), waits for the next one, or is discarded."""
    ended = time.time()
    with _live_lock:
        _live_groups.pop(worker.proc.pid, None)
        keep = code == 0 and worker.alive and not _stopped.is_set()
        successor = _successors.pop(config.trial_id, None)
        # A ticket its worker did not take is nobody's from now on (a retry of this trial, in
        # another worker, must not find it: what was staged goes back to the queue).
        claimed = successor is not None and _claim_ticket(config.trial_id)
    passed = worker.reply.get("next") if code == 0 else None  # what the worker did with the ticket it took
    started_next = passed is not None and passed.get("started")
    with _live_lock:  # its record's interval ends here, before the next trial's in its worker begins (run_plan)
        _ended_at[config.trial_id] = min(ended, float(passed["at"])) if started_next else ended
    if started_next:
        if keep and successor is not None and _adopt(worker, successor, passed):
            return
        worker.discard()  # the trial it started is stopped with it (the campaign stops) ...
        if successor is not None:
            successor.abandon()  # ... before its lease is given back
        return
    if not keep:
        worker.discard()
    elif not (claimed and _hand_over(worker, successor)):
        with _live_lock:
            _idle_workers.setdefault(worker.key, []).append(worker)  # warm for the next trial
            _ended.add(config.trial_id)  # a successor staged from now on starts in an idle worker at once


# --- a warm worker handed straight to the next trial -------------------------------------------

@dataclass
class Successor:
    """A trial the campaign staged to run next in the warm worker of a running one, on its
    device: no round trip through the campaign's loop and its task runs between one trial's
    end and the next one's first step. The worker itself moves the device's lease to it and
    starts it, from the ticket the campaign writes at once (`config`, `lease`: see
    tasks/warm_worker.py), and the campaign `adopt`s what it did (the grant: its lease renewed
    from then on; returns the successor's config with its lease). If the worker could not
    look for the ticket in time (written after its trial ended), `take_over` does it in the
    campaign (the lease moved, its config returned; None when it cannot start now: it then
    starts the usual way). `abandon`: the successor was started and stopped again at once
    (the campaign stops): its lease is given back."""
    plan: LaunchPlan
    config: TrialConfig  # without its lease
    lease: dict  # the worker's lease transaction (tasks/warm_worker.py's ticket)
    take_over: Callable[[], TrialConfig | None]
    adopt: Callable[[dict], TrialConfig]
    abandon: Callable[[], None]
    env: dict[str, str] = field(default_factory=dict)  # the environment its ticket gives the worker


@dataclass
class _Handed:
    """A trial started by hand_over: a thread of its own follows it (`_follow`), so that its
    end is seen, and the trial after it started, whether or not its task has come yet."""
    at: float  # when it was started
    log_offset: int  # its log's size then: what its task run forwards starts there
    done: threading.Event = field(default_factory=threading.Event)
    code: int = 1  # its exit code, once done


_successors: dict[str, Successor] = {}  # a running trial -> the one staged after it
_ended: set[str] = set()  # trials whose warm worker ended them well with nothing staged after: it went idle
_handed: dict[str, _Handed] = {}  # a trial started by hand_over whose task has not yet taken it
_ended_at: dict[str, float] = {}  # a warm trial's end as its worker's reply says it, for its record (ended_at)
_tickets: Path | None = None  # this campaign's folder of tickets (private: they carry its environment)


def _ticket_path(trial_id: str) -> Path:
    """Where the ticket of the trial staged after `trial_id` is (see tasks/warm_worker.py)."""
    global _tickets
    if _tickets is None:
        _tickets = private_temp_dir("campaign-handover-")
    return _tickets / f"after-{trial_id}.json"


def _write_ticket(trial_id: str, successor: Successor) -> None:
    plan, config = successor.plan, successor.config
    successor.env = {**os.environ, **plan.env}
    request = {"config": str(plan.config_path), "log": str(plan.log_path), "env": successor.env, "unset": [],
               "next": str(_ticket_path(config.trial_id))}
    ticket = {"trial": config.trial_id, "request": request, "config": dataclasses.asdict(config), "lease": successor.lease}
    write_atomic(_ticket_path(trial_id), json.dumps(ticket).encode(), durable=False)  # whole or not at all: renamed into place


def _claim_ticket(trial_id: str) -> bool:
    """Take back the ticket after `trial_id` before its worker does; False if it took it (or there is none)."""
    if _tickets is None:  # no ticket was written (or the campaign has closed): nothing to make a folder for
        return False
    try:
        (_tickets / f"after-{trial_id}.json").unlink()
        return True
    except FileNotFoundError:
        return False


def ticket_taken(trial_id: str) -> bool:
    """Whether the worker of `trial_id` took the ticket after it: its lease is passed on, not lost."""
    return _tickets is not None and (_tickets / f"after-{trial_id}.json.taken").exists()


def _drop_tickets() -> None:
    """No trial starts from a ticket any more (the campaign stops or ends)."""
    for trial_id in list(_successors):
        _claim_ticket(trial_id)


def stage_successor(trial_id: str, successor: Successor) -> None:
    """Stage `successor` after the running trial `trial_id` (see Successor). If that one has
    ended already and its worker waits idle, the successor starts in it now."""
    with _live_lock:
        if trial_id not in _ended:
            _successors[trial_id] = successor
            _write_ticket(trial_id, successor)
            return
        worker = _take_idle(warm_key(successor.plan))
    if worker is not None and not _hand_over(worker, successor):
        with _live_lock:
            _idle_workers.setdefault(worker.key, []).append(worker)


def unstage_successor(trial_id: str) -> bool:
    """What was staged after `trial_id` is no longer; False if it was not staged (any more):
    its take-over began, or it never was."""
    with _live_lock:
        if trial_id not in _successors or not _claim_ticket(trial_id):
            return False
        del _successors[trial_id]
        return True


def start_in_idle_worker(plan: LaunchPlan, config: TrialConfig) -> bool:
    """Start the trial now in an idle warm worker for its plan, if there is one (its task,
    submitted next, finds it running: see _Handed); False if none is idle. The trial's
    lease is held and its config complete."""
    with _live_lock:
        worker = _take_idle(warm_key(plan))
    if worker is None:
        return False
    if _start_handed(worker, plan, config):
        return True
    with _live_lock:
        _idle_workers.setdefault(worker.key, []).append(worker)
    return False


def ended_at(trial_id: str) -> float | None:
    """When a warm worker's trial ended, taken once: no later than the start of the trial its
    worker started after it (the campaign reads the reply after that start)."""
    with _live_lock:
        return _ended_at.pop(trial_id, None)


def handed_over(trial_id: str) -> tuple[float, int] | None:
    """(when, its log's offset then) if `trial_id` was started by hand_over and its task has not yet taken it."""
    with _live_lock:
        handed = _handed.get(trial_id)
    return (handed.at, handed.log_offset) if handed is not None else None


def _hand_over(worker: WarmWorker, successor: Successor) -> bool:
    """Start the staged trial in `worker`, whose trial has just ended well; False if it did not start."""
    if warm_key(successor.plan) != worker.key:
        return False
    try:
        config = successor.take_over()
    except Exception as e:  # its normal start says what is wrong, if anything still is
        log.warning("the next trial did not start in the warm worker at once: %s: %s", e.__class__.__name__, e)
        return False
    return config is not None and _start_handed(worker, successor.plan, config)


def _adopt(worker: WarmWorker, successor: Successor, passed: dict) -> bool:
    """The worker started the staged trial itself (`passed`: its reply): the campaign takes
    over its lease and follows it. False if it cannot (the campaign stops): it is stopped."""
    try:
        config = successor.adopt(passed["grant"])
    except Exception as e:
        log.warning("the trial the warm worker started next is stopped: %s: %s", e.__class__.__name__, e)
        return False
    worker.env = {**worker.env, **successor.env}  # what the worker's environment is now (see WarmWorker.send)
    with _live_lock:
        if campaign_stopping(config.trial_id):
            return False
        _live_groups[worker.proc.pid] = config.trial_id
        _handed[config.trial_id] = handed = _Handed(float(passed["at"]), int(passed["offset"]))
    _follow_in_thread(worker, config, handed)
    return True


def _start_handed(worker: WarmWorker, plan: LaunchPlan, config: TrialConfig) -> bool:
    """Send `worker` the trial (its lease held) ahead of its task, followed by a thread of its own."""
    trial_dir = Path(config.trial_dir)
    trial_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(plan.config_path, config.to_json().encode())
    clear_failure(trial_dir)  # what its processes record from now on is this segment's (training.failure)
    with _live_lock:
        if campaign_stopping(config.trial_id):
            return False
        offset = plan.log_path.stat().st_size if plan.log_path.exists() else 0
        if not worker.send(plan, config.trial_id):
            return False
        _live_groups[worker.proc.pid] = config.trial_id
        _handed[config.trial_id] = handed = _Handed(time.time(), offset)
    _follow_in_thread(worker, config, handed)
    return True


def _follow_in_thread(worker: WarmWorker, config: TrialConfig, handed: _Handed) -> None:
    threading.Thread(target=_follow, args=(worker, config, handed), name=f"warm {config.trial_id}", daemon=True).start()


def _follow(worker: WarmWorker, config: TrialConfig, handed: _Handed) -> None:
    code = None
    try:
        code = worker.wait()
    finally:
        handed.code = 1 if code is None else code
        try:
            _after_trial(worker, config, code)
        finally:
            handed.done.set()


def _refuse_lost_lease(config: TrialConfig) -> None:
    """A launch (a first one, or a task's retry) on a lease that is gone, granted again or
    past its renew deadline never starts: the devices may be another campaign's already.
    The trial counts as revoked, so the campaign queues it again (`readmit`)."""
    if (problem := lease_problem(config.lease)) is not None:
        with _live_lock:
            _revoked.add(config.trial_id)
        raise TrialStopped(f"trial {config.trial_id}: not launched, its leases were lost ({problem})")


def apply_launch(plan: LaunchPlan, config: TrialConfig) -> int:
    if plan.warm and handed_over(config.trial_id):  # started under its lease, which may be given on since it ended
        return _run_warm(plan, config)
    _refuse_lost_lease(config)
    write_atomic(plan.config_path, config.to_json().encode())
    timings.mark_first("launched", f"the first trial's processes start ({'a warm worker' if plan.warm else 'a new process'})")
    if plan.warm:
        return _run_warm(plan, config)
    if plan.elastic:  # a new agent starts a new command sequence
        control = plan.control or control_dir(config)
        clear_commands(control)
        write_command(control, 0, list(plan.workers))
    with _registered_group(plan, config, "not launched") as proc:
        return proc.wait()


@contextlib.contextmanager
def _registered_group(plan: LaunchPlan, config: TrialConfig, refused: str) -> Iterator[subprocess.Popen]:
    """Start `plan`'s command in a process group of its own, registered as the trial's: a
    campaign that stops, or the trial's lease lost, ends it (SIGTERM to the group). Not started
    (TrialStopped, saying `refused` and why) once either has happened; ended if the caller is
    interrupted; unregistered when it has ended."""
    with open(plan.log_path, "ab") as log, _live_lock:
        _refuse_if_stopping(config, refused)
        proc = subprocess.Popen(
            plan.command, cwd=plan.cwd, env={**os.environ, **plan.env, TRIAL_MARK: _trial_mark},
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_torchrun_dies_with_campaign,
        )
        _live_groups[proc.pid] = config.trial_id  # start_new_session: the group id is its pid
    try:
        yield proc
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    finally:
        with _live_lock:
            _live_groups.pop(proc.pid, None)


def plan_host_launch(config: TrialConfig, store: str, node: str, lease: dict, address: str, interface: str, ready: Path,
                     python: str = sys.executable) -> LaunchPlan:
    """A pool node's host of an elastic trial whose agent runs on another node (training.elastic_host):
    it starts the workers the agent asks for here, which listen on this node's address and watch
    this node's `lease` (training.fence); it writes `ready` once it serves the agent (under a new
    incarnation, which the agent then asks); its output goes to the trial's `train-<node>.log`."""
    command = [python, "-m", "training.elastic_host", "--store", store, "--node", node, "--lease", json.dumps(lease), "--ready", str(ready),
               "--trial-dir", str(config.trial_dir)]
    env = {**launch_env(), BIND_ENV: address, "GLOO_SOCKET_IFNAME": interface}
    log = trial_files(config.trial_dir).log
    return LaunchPlan(command, env, Path.cwd(), trial_files(config.trial_dir).config, of_node(log, node))


def run_host(plan: LaunchPlan, config: TrialConfig, ready: Path, on_ready: Callable[[], None], done: Callable[[], bool],
             every_s: float = 0.2) -> int:
    """Run a host (plan_host_launch), call `on_ready()` once it has written `ready`, and run it
    until it ends by itself (the agent's store went: the trial ended or its node was lost) or,
    once ready, `done()` says its node has no part in the trial any more; then it is ended
    (SIGTERM: it kills its workers first). Its exit code. A campaign that stops, or a lease
    lost, ends it as it ends any trial process (its group is registered)."""
    with _registered_group(plan, config, "no host started") as proc:
        up = ended = False
        while True:
            try:
                return proc.wait(timeout=every_s)
            except subprocess.TimeoutExpired:
                pass
            if not up and ready.exists():
                up = True
                on_ready()
            if up and not ended and done():
                os.killpg(proc.pid, signal.SIGTERM)
                ended = True


def log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except FileNotFoundError:
        return ""


def _retried_if_infrastructure(task, task_run, state) -> bool:
    """run_trial's retry condition: retries are for infrastructure failures (a worker lost or
    killed by a signal, an error in this project's code or a library it calls, a lease
    problem). A stall, an exception in the user's own code and a full disk would only happen
    again: not retried (the campaign's own record writes finding no room included)."""
    return not isinstance(state.data, (NotRetried, DiskFull))


@task(retries=1, retry_delay_seconds=2, retry_condition_fn=_retried_if_infrastructure)
def run_trial(config: TrialConfig, devices: list[Device], cwd: str, elastic: bool = False, warm: bool = False) -> dict[str, Any]:
    """One segment of a trial on its devices; a retry resumes from the last checkpoint.

    Returns the trial's result, or {"preempted": True} when it was resized to zero devices.
    """
    if campaign_stopping(config.trial_id):  # a retry after a stop: leave the record as the stop wrote it
        raise TrialStopped(f"trial {config.trial_id}: not launched, the campaign is stopping or its leases were lost")
    return run_plan(plan_launch(config, devices, Path(cwd), elastic=elastic, warm=warm), config, devices)


# --- a segment's memory: its peak, and the out-of-memory killer ------------------------------------

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMORY_POLL_S = 1.0


def oom_kill_count(events: str | None) -> int | None:
    """The out-of-memory killer's count in a cgroup's `memory.events` (cgroup v2) or
    `memory.oom_control` (v1): both hold an `oom_kill N` line. None when there is none."""
    for line in (events or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def oom_killed(before: str | None, after: str | None) -> bool:
    """Whether the out-of-memory killer killed a process of the cgroup between two readings
    of its `memory.events` (or v1 `memory.oom_control`)."""
    first, last = oom_kill_count(before), oom_kill_count(after)
    return first is not None and last is not None and last > first


def oom_events_file(pid: int, root: Path = CGROUP_ROOT) -> Path | None:
    """Where the memory cgroup of process `pid` counts its out-of-memory kills: cgroup v1's
    memory controller (`memory/<path>/memory.oom_control`; a hybrid host has its memory there),
    else v2's `<path>/memory.events`. None where neither can be read."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1, v2 = [], []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        inside = path.strip().lstrip("/")
        if "memory" in controllers.split(","):
            v1.append(root / "memory" / inside / "memory.oom_control")
        elif controllers == "":
            v2 += [root / inside / "memory.events", root / "unified" / inside / "memory.events"]
    return next((f for f in v1 + v2 if f.is_file()), None)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _status_bytes(pid: int) -> tuple[int, int]:
    """(resident now, its peak: VmHWM) of a process, in bytes; (0, 0) once it is gone."""
    now = peak = 0
    for line in (_read(Path(f"/proc/{pid}/status")) or "").splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            value = int(line.split()[1]) * 1024
            now, peak = (value, peak) if line.startswith("VmRSS:") else (now, value)
    return now, peak


class MemoryWatch:
    """A segment's memory, watched from beside it (a thread, every MEMORY_POLL_S): the peak of its
    processes' resident memory (their sum, or one process's own high-water mark, whichever is
    larger), and the out-of-memory killer's count of each cgroup they run in, read when the cgroup
    is first seen (this process's own at the start: its children are in it) and again at the end.
    A SIGKILL with the count grown is the out-of-memory killer's (`oom_killed`)."""

    def __init__(self, processes: Callable[[], list[int]], every_s: float | None = None):
        self.processes, self.every_s = processes, every_s or MEMORY_POLL_S
        self.peak_bytes = 0
        self.before: dict[Path, str | None] = {}
        self._see(os.getpid())
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def _see(self, pid: int) -> None:
        if (events := oom_events_file(pid)) is not None and events not in self.before:
            self.before[events] = _read(events)

    def sample(self) -> None:
        total = 0
        for pid in self.processes():
            self._see(pid)
            now, peak = _status_bytes(pid)
            total += now
            self.peak_bytes = max(self.peak_bytes, peak)
        self.peak_bytes = max(self.peak_bytes, total)

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # a process that went while it was read: the next sample sees the rest
                pass
            if self._done.wait(self.every_s):
                return

    def oom_killed(self) -> bool:
        return any(oom_killed(before, _read(events)) for events, before in self.before.items())

    def __enter__(self) -> "MemoryWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def failure_reason(code: int, failure: Failure | None, oom: bool = False, peak_bytes: int | None = None) -> str:
    """Why a segment failed, in one line: the first failure its processes recorded
    (training.failure: an exception's own line, a full disk, a worker's signal), else its exit
    code, a negative one as the signal's name. A SIGKILL is the out-of-memory killer's when
    `oom` (the cgroup's count grew meanwhile): said so, with the peak memory seen."""
    if failure is not None and failure.kind != SIGNAL:
        return failure.line
    signum = failure.signal if failure is not None else -code if code < 0 else None
    said = failure.line if failure is not None else exit_description(code)
    if signum == signal.SIGKILL and oom:
        peak = f" (peak memory {size_text(peak_bytes)})" if peak_bytes else ""
        return said.replace(f"killed by {signal_name(signal.SIGKILL)}", f"killed by the out-of-memory killer{peak}")
    return said


def segment_watchdog(plan: LaunchPlan, config: TrialConfig, across_nodes: bool = False) -> Watchdog:
    """The segment's stall watchdog (tasks/watchdog.py), stopping the trial's process groups of
    this process. A trial across nodes is not watched: its rank 0, which writes its progress,
    may be on a node whose files this one does not see."""
    return Watchdog(Path(config.trial_dir), None if across_nodes else config.stall_timeout_s, plan.log_path,
                    lambda: trial_process_groups(config.trial_id))


def drop_partial_checkpoints(trial_dir: Path) -> None:
    """Remove the trial's checkpoints that were never put in view (`.tmp-*`: their writer ended)."""
    for partial in trial_files(trial_dir).checkpoints.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(partial, ignore_errors=True)


def run_plan(plan: LaunchPlan, config: TrialConfig, devices: list[Device], record: bool = True,
             all_devices: list[str] | None = None) -> dict[str, Any]:
    """Apply a segment's launch plan and say how it ended (see run_trial). `record`: this
    process keeps the trial's record (of a trial across nodes, only the host node's does,
    with `all_devices`, every node's)."""
    trial_dir = Path(config.trial_dir)
    trial_dir.mkdir(parents=True, exist_ok=True)

    def update(**fields) -> TrialRecord:
        if not record or launched_again(config.lease or {}):
            # (a segment of a launch the trial no longer runs under: the record is the new one's)
            return TrialRecord()
        try:
            return update_record(trial_dir, **fields)
        except DiskFull:
            if all_devices is not None:  # other nodes may still write into the folder: nothing of theirs is ours to drop
                raise
            # No process of this segment runs now (before its launch, or after it ended): a
            # checkpoint it left half-written for want of room is never put in view, and its
            # room lets the record say what happened (a resume would remove it anyway).
            drop_partial_checkpoints(trial_dir)
            return update_record(trial_dir, **fields)

    ids = all_devices or [d.id for d in devices]
    held = read_trial_record(trial_dir) if record else TrialRecord()
    # Started already by the worker of the trial before it (hand_over), whose take-over cleared its failure.
    started, log_offset = handed_over(config.trial_id) or (time.time(), None)
    # Who had which device when: one interval per attempt.
    intervals = [*held.intervals, {"devices": ids, "start": started, "end": None}]
    update(state="running", devices=ids, reason=None, attempts=held.attempts + 1, intervals=intervals)
    if log_offset is None:
        clear_failure(trial_dir)  # what its processes record from now on is this segment's (training.failure)

    def processes() -> list[int]:  # what MemoryWatch samples: the segment's process groups and their descendants
        groups = trial_process_groups(config.trial_id)
        return trial_processes(groups) if groups else []

    try:
        with LogForwarder(plan.log_path, log_offset), segment_watchdog(plan, config, across_nodes=all_devices is not None) as watchdog, \
                MemoryWatch(processes) as memory:
            code = apply_launch(plan, config)
    except BaseException:
        intervals[-1]["end"] = ended_at(config.trial_id) or time.time()
        update(intervals=intervals)
        raise
    intervals[-1]["end"] = ended_at(config.trial_id) or time.time()
    result = completed_result(trial_dir)
    if result is not None:  # finished, whatever happened after: a worker killed after the result changes nothing
        update(state="finished", exit_code=code, intervals=intervals)
        return result
    update(intervals=intervals)
    if _stopped.is_set():
        update(state="stopped", exit_code=code)
        raise TrialStopped(f"trial {config.trial_id} was stopped with its campaign; it resumes from its last checkpoint")
    if config.trial_id in _revoked:
        update(state="lease lost", exit_code=code)
        raise TrialStopped(f"trial {config.trial_id} was stopped: its leases were lost; it resumes from its last checkpoint")
    if watchdog.stall is not None and queued_again(watchdog.stall, held.reason):
        update(state="preempted", exit_code=code, reason=watchdog.stall.reason)
        return {"preempted": True, "stalled": watchdog.stall.reason}
    if watchdog.stall is not None:  # stopped by its watchdog: a final failure, its devices free for the queue
        update(state="failed", exit_code=code, reason=watchdog.stall.reason)
        raise TrialStalled(f"trial {config.trial_id} {watchdog.stall.reason}: stopped, not retried (training.stall_timeout_s: "
                           f"{config.stall_timeout_s}; raise it, or null, if it was only slow); its Python stacks are in "
                           f"{plan.log_path}:\n{log_tail(plan.log_path)}")
    if (plan.elastic and code == PREEMPTED) or (code == 0 and config.stop_path and Path(config.stop_path).exists()):
        update(state="preempted", exit_code=code)  # stopped at a checkpoint, by its agent or its stop file
        return {"preempted": True}
    failure = read_failure(trial_dir)
    reason = failure_reason(code, failure, memory.oom_killed(), memory.peak_bytes)
    update(state="failed", exit_code=code, reason=reason)
    if failure is not None and failure.kind == USER:  # its traceback is whole in its log, once
        raise TrialRaised(f"trial {config.trial_id} failed: {reason}\nan exception in the trial's own code: not retried "
                          f"(it would be raised again); its whole traceback is in {plan.log_path}")
    if failure is not None and failure.kind == DISK_FULL:
        raise TrialDiskFull(f"trial {config.trial_id} failed: {reason}\nnot retried (it would fill the disk again); "
                            f"its log: {plan.log_path}")
    raise TrialFailed(f"trial {config.trial_id} failed: {reason}\nend of {plan.log_path}:\n{log_tail(plan.log_path)}")
