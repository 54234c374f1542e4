"""The agent of an elastic trial: one worker per device, resized on command, fast.

    python -m training.elastic --config trial.json --control <dir>

The launcher writes commands (training.agent_commands) as `<dir>/command-<seq>.json`: `{"seq", "devices": [{"id",
"env"}], "mode": "resize" | "restart", "requested_at"}`. Sequence 0 starts the trial. The
agent applies each command in order and writes what it runs now to `<dir>/state.json`.

A resize (the fast path):
1. start workers for the new devices; they load everything while the trial keeps training;
2. when they are ready, ask the current generation to stop, at a control step;
3. start the next generation: the workers that stay keep their state in memory and rank 0
   (always one that stays) broadcasts it to the joiners; workers not in it exit.
With no worker staying (a move to all-new devices) the state goes through the durable
checkpoint instead. `"mode": "restart"` is the naive path, kept for comparison: stop,
checkpoint to disk, end every process, start all anew, load from disk. A function trial
(training.function: its state is in the user's code) always moves through its own save:
new processes for the new size start while it trains, then it is told to stop (it saves
and returns) and the new ones load that save. An empty device
list preempts: checkpoint, stop everything, exit with PREEMPTED.

If any worker dies, the agent ends the others and exits non-zero: the launcher's retry
resumes from the last complete checkpoint (a half-written one is never loaded).

Across nodes (`--node`, and a device's `"node"` in a command): a device on another node is
served by that node's host (training.elastic_host), connected to this agent's store, which
then listens on this node's address ($CAMPAIGN_BIND_ADDR, port `--store-port`). Its workers
are seen here as RemoteProcess; the fast path above is the same, with the stop signals in
the store instead of files. Rank 0 stays on the agent's node (it writes the trial's
progress, result and metrics where the campaign reads them): a command with no device here
is refused (`refused-<seq>.json`, as a pool node's relay refuses), and the trial goes on as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from training.config import TrialConfig
from training.agent_commands import AgentCommand, read_command, refuse
from training.failure import exit_description, signal_failure, write_failure
from training.files import write_json_atomic
from training.elastic_host import LOST_S, host_key, incarnation_key, sign_request, stop_key
from training.loopback import bind_address, loopback_store
from training.progress import read_progress
from training.process import die_with_parent, skip_final_collection
from training.agent_state import agent_state_now
from training.layout import command_in
from training.zygote import ForkedProcess, Zygote, ZygoteGone

FINISHED, FAILED, PREEMPTED = 0, 1, 3
TERM_SAVE_S = 7.0  # a stopping campaign waits 10 s (tasks/trial.py STOP_GRACE_S) before SIGKILL: the save must fit in it
POLL_S = 0.005  # while a resize is under way: the pause waits on these polls
# While the trial just trains: how soon a new command is seen. Each wake-up takes a core
# from a rank for a moment (the ranks of a CPU trial have one core each), and a command
# waits for its joiners' start-up (seconds) anyway.
IDLE_POLL_S = 0.1
LEAVE_S = 60.0  # a worker told to leave has this long to exit before it is killed


WORKER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # read as a worker's interpreter and torch start


def worker_env(device_env: dict[str, str], wid: str, store_host: str, store_port: int) -> dict[str, str]:
    """What a worker starts with, on the agent's node or a host's (training.elastic_host): its
    node's environment, its device's, and where the agent's store is."""
    return {**os.environ, **device_env, "CAMPAIGN_WORKER_ID": wid, "CAMPAIGN_STORE_ADDR": store_host,
            "CAMPAIGN_STORE_PORT": str(store_port), **WORKER_ENV}


def worker_name(wid: str) -> str:
    """An elastic worker's process name (`ps -o comm`): its command line is its zygote's."""
    return f"elastic {wid}"


class WorkerDied(RuntimeError):
    def __init__(self, message: str, code: int | None = None, pid: int | None = None):
        super().__init__(message)
        self.code, self.pid = code, pid  # how the worker ended, when it ended by itself


class CannotPlace(RuntimeError):
    """The first command names no device on the agent's node (rank 0 stays there)."""


@dataclass
class Worker:
    wid: str
    device: dict  # as the command gave it: {"id", "env"[, "node"]}
    proc: "subprocess.Popen | ForkedProcess | RemoteProcess"
    assignments: int = 0
    leaving: bool = False

    @property
    def device_id(self) -> str:
        return self.device["id"]


class RemoteProcess:
    """A worker that another node's host started (training.elastic_host), seen through the
    agent's store as much like a Popen as the agent needs: its exit code is the one its host
    reports, or SIGKILL's once the host's beat has stopped for LOST_S (the node is lost)."""

    CHECK_S = 0.05  # the agent polls every few ms while a resize is under way: a round trip each would add up

    def __init__(self, store, node: str, incarnation: int, wid: str, beats: "NodeBeats"):
        self.store, self.node, self.incarnation, self.wid, self.beats = store, node, incarnation, wid, beats
        self.pid = None
        self.code: int | None = None
        self.why = ""  # the host's reason, for a worker it refused to start
        self.checked = 0.0

    def poll(self) -> int | None:
        if self.code is None and time.time() - self.checked >= self.CHECK_S:
            self.checked = time.time()
            key = host_key(self.node, self.incarnation, "exit", self.wid)
            if self.store.check([key]):
                self.code = int(self.store.get(key))
                why = host_key(self.node, self.incarnation, "why", self.wid)
                self.why = self.store.get(why).decode() if self.store.check([why]) else ""
            elif self.beats.lost(self.node, self.incarnation):
                self.code = -signal.SIGKILL
        return self.code

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(self.CHECK_S)
        return self.code

    def kill(self) -> None:
        if self.code is None:
            self.store.set(host_key(self.node, self.incarnation, "kill", self.wid), "")


class NodeBeats:
    """When each remote node's host last beat (training.elastic_host adds to its beat key)."""

    def __init__(self, store):
        self.store = store
        self.seen: dict[tuple[str, int], tuple[int, float]] = {}  # (node, incarnation) -> (beats, when they last changed)

    def lost(self, node: str, incarnation: int) -> bool:
        count = self.store.add(host_key(node, incarnation, "beat"), 0)
        last, since = self.seen.get((node, incarnation), (-1, time.time()))
        if count != last:
            self.seen[(node, incarnation)] = (count, time.time())
            return False
        return time.time() - since > LOST_S

    def host(self, node: str, address: str, timeout_s: float) -> int:
        """The incarnation of the node's host that beats now; TimeoutError, saying how to start
        one, if none comes within `timeout_s` (none yet, or the last one lost)."""
        deadline = time.time() + timeout_s
        while True:
            incarnation = self.store.add(incarnation_key(node), 0)
            if incarnation > 0 and not self.lost(node, incarnation):
                return incarnation
            if time.time() > deadline:
                raise TimeoutError(f"no host for node {node!r} on this agent's store after {timeout_s:.0f} s: start "
                                   f"`python -m training.elastic_host --store {address} --node {node}` there")
            time.sleep(POLL_S)


HOST_WAIT_S = 120.0  # a device on another node: how long its host may take to connect


class Agent:
    def __init__(self, config: Path, control: Path, python: str = sys.executable, node: str | None = None, store_port: int = 0):
        self.config, self.control, self.python, self.node = config, control, python, node
        self.zygote: Zygote | None = None  # started with the first worker (forked_worker)
        self.store = loopback_store(store_port, wait_for_workers=False, timeout=timedelta(days=7), address=bind_address())
        self.beats = NodeBeats(self.store)
        self.spawned: dict[tuple[str, int], int] = {}  # (node, incarnation) -> how many workers its host was asked for
        self.workers: dict[str, Worker] = {}
        self.members: list[str] = []
        self.gen = -1
        self.seq = -1
        self._next_wid = 0
        self._restart_only: bool | None = None
        self.terminating = False  # SIGTERM to a function trial's agent: the campaign is stopping (see main)
        for stale in control.glob("stop-*"):  # an earlier agent's generations: numbering starts again
            stale.unlink()

    @property
    def restart_only(self) -> bool:
        """A function trial (training.function) holds its state in the user's code: it moves by
        checkpoint-restart only (the function saves when should_stop says so)."""
        if self._restart_only is None:
            self._restart_only = TrialConfig.from_file(self.config).function is not None
        return self._restart_only

    # --- workers -------------------------------------------------------------------
    def remote(self, device: dict) -> bool:
        return device.get("node") not in (None, self.node)

    def local(self, wid: str) -> bool:
        return not isinstance(self.workers[wid].proc, RemoteProcess)

    def store_address(self) -> str:
        return f"{self.store.host}:{self.store.port}"

    def spawn(self, device: dict) -> str:
        wid = f"w{self._next_wid}"
        self._next_wid += 1
        if self.remote(device):
            self.workers[wid] = Worker(wid, device, self.spawn_remote(device, wid))
            return wid
        env = worker_env(device.get("env", {}), wid, self.store.host, self.store.port)
        args = ["--config", str(self.config)]
        try:
            proc = self.forked_worker(args, env, worker_name(wid))
        except ZygoteGone:  # started on its own, as before the zygote
            proc = subprocess.Popen([self.python, "-m", "training.elastic_worker", *args], env=env)
        self.workers[wid] = Worker(wid, device, proc)
        return wid

    def spawn_remote(self, device: dict, wid: str) -> RemoteProcess:
        """Ask the device's node's host for the worker. Only the device's own environment goes
        with it: the rest (its interfaces, paths) is the host's node's."""
        node = device["node"]
        incarnation = self.beats.host(node, self.store_address(), HOST_WAIT_S)
        k = self.spawned.get((node, incarnation), 0)
        self.spawned[(node, incarnation)] = k + 1
        request = {"wid": wid, "env": device.get("env", {}), "config": str(self.config.resolve()),
                   "config_text": self.config.read_text()}
        key = host_key(node, incarnation, "spawn", str(k))
        self.store.set(key, json.dumps(sign_request(key, request)))  # a host runs only what this agent signed
        return RemoteProcess(self.store, node, incarnation, wid, self.beats)

    def forked_worker(self, args: list[str], env: dict[str, str], name: str) -> ForkedProcess:
        """The workers are forked from one process that imports torch and the trainer once
        (training/zygote.py): a joiner is ready for its state seconds sooner, and the first
        generation pays one import, not one per device. The zygote is in the agent's process
        group: a stop of the trial reaches every process of it."""
        if self.zygote is None:
            self.zygote = Zygote(["training.elastic_worker"], Path.cwd(), {**os.environ, **WORKER_ENV}, self.python, output=None,
                                 serves=str(self.config))
        return self.zygote.fork("training.elastic_worker", args, env, Path.cwd(), name=name)

    def assign(self, wid: str, payload: dict) -> None:
        worker = self.workers[wid]
        self.store.set(f"assign/{wid}/{worker.assignments}", json.dumps(payload))
        worker.assignments += 1

    def check_workers(self) -> None:
        """Reap workers that left as told; any other exit is a failure of the trial. A worker told
        to leave is out of every generation from then on, so however it ends (its host on another
        node may end it first: that node has no part in the trial any more) nothing is lost."""
        for wid, worker in list(self.workers.items()):
            code = worker.proc.poll()
            if code is None:
                continue
            if worker.leaving:
                if code != 0:
                    print(f"elastic agent: worker {wid} on {worker.device_id}, told to leave, ended with code {code}", flush=True)
                del self.workers[wid]
                continue
            if code == 0 and wid in self.members:
                continue  # finished training: the agent sees all members end
            why = f" ({worker.proc.why})" if getattr(worker.proc, "why", "") else ""
            raise WorkerDied(f"worker {wid} on {worker.device_id} {exit_description(code)}{why}", code, getattr(worker.proc, "pid", None))

    def members_finished(self) -> bool:
        return bool(self.members) and all(self.workers[w].proc.poll() == 0 for w in self.members)

    def wait_for(self, keys: list[str], timeout_s: float = 600.0) -> bool:
        """Wait for the store keys; False if the trial finished first (nothing left to resize)."""
        deadline = time.time() + timeout_s
        while not self.store.check(keys):
            self.check_workers()
            if self.members_finished():
                return False
            if time.time() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f} s for {keys}")
            time.sleep(POLL_S)
        return True

    def kill_all(self, wait: bool = True) -> None:
        for worker in list(self.workers.values()):
            if isinstance(worker.proc, RemoteProcess):
                try:
                    worker.proc.kill()
                except RuntimeError:  # the store's client failed: the host ends its workers when this agent's store goes
                    pass
                continue
            try:
                os.kill(worker.proc.pid, signal.SIGKILL)  # not Popen.kill: it polls, under a lock (see main)
            except ProcessLookupError:
                pass
        if wait:
            for worker in self.workers.values():
                worker.proc.wait()

    # --- generations ---------------------------------------------------------------
    def start_generation(self, members: list[str], source: str, joiners: list[str], request: dict | None) -> None:
        self.gen += 1
        self.members = members
        payload = {"gen": self.gen, "members": members, "source": source, "joiners": joiners, "request": request,
                   "stop_path": str(self.stop_path(self.gen)), "spans_nodes": not all(self.local(w) for w in members)}
        for wid in members:
            self.assign(wid, payload)

    def stop_generation(self, save: bool, timeout_s: float = 3600) -> dict | None:
        """Ask the running generation to stop (its rank 0 sees the file at its next control
        step, every rank stops two control steps later): its stop record, or None when it finished
        training before it could stop."""
        write_json_atomic(self.stop_path(self.gen), {"save": save}, durable=False)
        self.store.set(stop_key(self.stop_path(self.gen)), json.dumps({"save": save}))  # for a generation across nodes
        if not self.wait_for([f"stopped/{self.gen}"], timeout_s=timeout_s):
            return None
        return json.loads(self.store.get(f"stopped/{self.gen}"))

    def stop_path(self, gen: int) -> Path:
        """The file that asks generation `gen` to stop (read by its rank 0, StopFlag)."""
        return self.control / f"stop-{gen}"

    def dismiss(self, wids: list[str]) -> None:
        for wid in wids:
            self.workers[wid].leaving = True
            self.assign(wid, {"exit": True})

    def devices(self) -> list[str]:
        return [self.workers[w].device_id for w in self.members]

    def write_state(self, status: str) -> None:
        agent_state_now(self.seq, self.gen, self.devices(), status).write(self.control)

    # --- commands ------------------------------------------------------------------
    def start(self, command: AgentCommand) -> None:
        if (reason := self.unplaceable(list(command.devices))) is not None:
            raise CannotPlace(f"command 0: {reason}")
        wids = [self.spawn(d) for d in sorted(command.devices, key=self.remote)]  # rank 0 on this node
        self.wait_for([f"ready/{w}" for w in wids])
        self.start_generation(wids, "disk", [], None)  # resume from the latest valid checkpoint, if any

    def apply(self, command: AgentCommand) -> int | None:
        """Apply one command; an exit code when the trial is to end, else None."""
        new = list(command.devices)
        before = self.devices()
        if not new:  # preemption: durable state, then every process ends
            if self.stop_generation(save=True) is None:
                return FINISHED
            self.dismiss(list(self.members))
            self.members = []
            return PREEMPTED
        if (reason := self.unplaceable(new)) is not None:
            refuse(self.control, command.seq, reason)
            return None
        new = sorted(new, key=self.remote)  # rank 0 on this node
        request = {"seq": command.seq, "mode": command.mode, "requested_at": command.requested_at, "from": before, "to": [d["id"] for d in new]}
        if self.restart_only:  # a function trial: every process new, started while the old ones train
            request["mode"] = "restart"
            wids = [self.spawn(d) for d in new]
            ready = self.wait_for([f"ready/{w}" for w in wids])
            request["ready_at"] = time.time()
            stopped = self.stop_generation(save=True) if ready else None  # the function saves and returns
            if stopped is None:
                self.dismiss(wids)
                return FINISHED
            self.dismiss(list(self.members))
            request.update(stopped_at=stopped["time"], last_step_at=stopped["last_step_at"])
            self.start_generation(wids, "disk", wids, request)
            return None
        if command.mode == "restart":
            stopped = self.stop_generation(save=True)
            if stopped is None:
                return FINISHED
            self.dismiss(list(self.members))
            self.members = []  # until the new generation starts, nobody trains
            wids = [self.spawn(d) for d in new]
            self.wait_for([f"ready/{w}" for w in wids])
            request.update(ready_at=time.time(), stopped_at=stopped["time"], last_step_at=stopped["last_step_at"])
            self.start_generation(wids, "disk", wids, request)
            return None
        by_device = {self.workers[w].device_id: w for w in self.members}
        stayers = sorted((w for w in self.members if self.workers[w].device_id in request["to"]), key=lambda w: not self.local(w))
        joiners = [self.spawn(d) for d in new if d["id"] not in by_device]
        ready = self.wait_for([f"ready/{w}" for w in joiners])  # the trial trains on meanwhile
        request["ready_at"] = time.time()
        stopped = self.stop_generation(save=not stayers) if ready else None
        if stopped is None:  # it finished before the resize could happen
            self.dismiss(joiners)
            return FINISHED
        request.update(stopped_at=stopped["time"], last_step_at=stopped["last_step_at"])
        self.dismiss([w for w in self.members if w not in stayers])
        self.start_generation(stayers + joiners, "memory" if stayers else "disk", joiners, request)
        return None

    def unplaceable(self, devices: list[dict]) -> str | None:
        """Why this agent cannot run on `devices`, or None: a trial across nodes keeps a device on the agent's."""
        if devices and all(self.remote(d) for d in devices):
            return (f"no device on the agent's node {self.node!r} (rank 0 stays there): "
                    f"{', '.join(d['id'] for d in devices)} all on other nodes")
        return None

    def next_command(self) -> AgentCommand | None:
        return read_command(self.control, self.seq + 1)

    def run(self) -> int:
        first = self.next_command()
        if first is None:
            raise FileNotFoundError(f"no {command_in(self.control, 0)}: nothing to start")
        self.seq = 0
        self.start(first)
        self.write_state("running")
        while True:
            if self.terminating:
                return self.stop_for_campaign()
            try:
                self.check_workers()
            except WorkerDied as died:
                if not self.go_on_without_lost_nodes(died):
                    raise
                self.write_state("running")
                continue
            if self.members_finished():
                self.write_state("finished")
                return FINISHED
            command = self.next_command()
            if command is not None:
                self.seq = command.seq
                outcome = self.apply(command)
                if outcome is not None:
                    self.wait_for_exits()
                    self.write_state("finished" if outcome == FINISHED else "preempted")
                    return outcome
                # The state says which devices the trial holds now: the campaign gives back the
                # others on reading it, so the workers that left them must be gone by then (a
                # leaver still holds its memory there, its data set on a GPU included).
                self.wait_for_leavers()
                self.write_state("running")
            time.sleep(IDLE_POLL_S)

    def go_on_without_lost_nodes(self, died: WorkerDied) -> bool:
        """A worker died while the trial spans nodes. If a node is lost (its host stopped
        beating: the machine, its network or the host gone), every process of the generation
        is ended and the trial goes on from its last complete checkpoint on the devices left,
        this node's among them: at most one checkpoint interval is trained again, and the
        node's devices come back with a later command, once a host there beats again. False
        when no node is lost: the death is the trial's own failure."""
        nodes = {(w.proc.node, w.proc.incarnation) for w in map(self.workers.get, self.members) if isinstance(w.proc, RemoteProcess)}
        if not nodes:
            return False
        seen_at, before = time.time(), self.devices()
        self.kill_all(wait=False)  # the others are stuck in, or fail at, a collective with the dead one
        lost: set[tuple[str, int]] = set()
        while not lost and time.time() < seen_at + LOST_S + 2.0:
            lost = {node for node in nodes if self.beats.lost(*node)}
            time.sleep(IDLE_POLL_S)
        if not lost:
            return False
        left = [w.device for w in map(self.workers.get, self.members)
                if not isinstance(w.proc, RemoteProcess) or (w.proc.node, w.proc.incarnation) not in lost]
        print(f"elastic agent: {died}; node(s) {', '.join(sorted(n for n, _ in lost))} lost: the trial goes on from its last "
              f"checkpoint on {', '.join(d['id'] for d in left)}", file=sys.stderr, flush=True)
        for worker in self.workers.values():  # killed above; a second kill could reach a reaped pid's next owner
            worker.proc.wait()
        self.workers.clear()
        self.members = []
        wids = [self.spawn(d) for d in left]
        self.wait_for([f"ready/{w}" for w in wids])
        progress = read_progress(TrialConfig.from_file(self.config).trial_dir)
        request = {"seq": self.seq, "mode": "node lost", "requested_at": seen_at, "from": before, "to": [d["id"] for d in left],
                   "ready_at": time.time(), "stopped_at": seen_at,
                   "last_step_at": min(seen_at, progress.updated) if progress is not None else seen_at}  # its last progress write
        self.start_generation(wids, "disk", wids, request)
        return True

    def stop_for_campaign(self) -> int:
        """The campaign is stopping (SIGTERM to the trial's process group): a function trial's
        workers got it too, and their should_stop() says so; the function saves where it is
        and returns. Wait for that save, let the workers go, and exit as preempted (the next
        launch resumes from the save). The stop file asks too, for a SIGTERM that reached the
        agent alone (its parent died)."""
        if not self.members:
            self.kill_all()
            self.write_state("failed")
            return FAILED
        try:
            stopped = self.stop_generation(save=True, timeout_s=TERM_SAVE_S)
        except (WorkerDied, TimeoutError) as e:
            print(f"elastic agent: stopping for the campaign: {e}; ending the trial's processes", file=sys.stderr, flush=True)
            self.kill_all()
            self.write_state("failed")
            return FAILED
        if stopped is not None:
            print(f"elastic agent: the campaign is stopping; the trial saved at step {stopped['step']}", flush=True)
            self.dismiss(list(self.members))
            self.members = []
        self.wait_for_exits()
        self.write_state("finished" if stopped is None else "preempted")
        return FINISHED if stopped is None else PREEMPTED

    def wait_for_leavers(self, timeout_s: float = LEAVE_S) -> None:
        """Until every worker told to leave has exited (the new generation trains meanwhile);
        one still there after `timeout_s` is killed. A member's death is left to the caller's
        next check."""
        deadline, killed = time.monotonic() + timeout_s, False
        while any(w.leaving for w in self.workers.values()):
            try:
                self.check_workers()
            except WorkerDied:
                return
            if time.monotonic() > deadline:
                if killed:
                    return  # not even reaped after SIGKILL (a lost node's): nothing more to wait for
                for wid, worker in self.workers.items():
                    if worker.leaving and worker.proc.poll() is None:
                        print(f"elastic agent: worker {wid} on {worker.device_id}, told to leave {timeout_s:.0f} s ago, "
                              "is still there: killed", flush=True)
                        worker.proc.kill()
                deadline, killed = time.monotonic() + timeout_s, True
            time.sleep(POLL_S)

    def wait_for_exits(self) -> None:
        """Until every worker told to leave (or finished) has exited."""
        while any(w.proc.poll() is None for w in self.workers.values()):
            self.check_workers()
            time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run an elastic trial: one worker per device, resized on command.")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--control", required=True, type=Path, help="directory of command-<seq>.json files")
    parser.add_argument("--node", help="this node's name: devices of other nodes are started by their hosts (training.elastic_host)")
    parser.add_argument("--store-port", type=int, default=0, help="the port of the trial's store (0: any free one; "
                        "a trial across nodes names it to its hosts)")
    args = parser.parse_args(argv)
    die_with_parent(signal.SIGTERM)
    skip_final_collection()  # a trial's end is seen when its agent has exited
    agent = Agent(args.config, args.control, node=args.node, store_port=args.store_port)
    # On SIGTERM: kill the workers and go, without waiting for them. The handler runs between
    # two bytecodes of the main thread, which may be inside Popen.poll holding Popen's wait
    # lock: Popen.wait here would wait on that lock forever (seen: an agent left running,
    # its worker a zombie). The workers are SIGKILLed; init reaps them.
    # A function trial's workers save on SIGTERM (should_stop): its handler only marks the
    # stop, and the main loop waits for that save (stop_for_campaign) within the campaign's grace.
    if agent.restart_only:
        signal.signal(signal.SIGTERM, lambda *_: setattr(agent, "terminating", True))
    else:
        signal.signal(signal.SIGTERM, lambda *_: (agent.kill_all(wait=False), os._exit(FAILED)))
    try:
        return agent.run()
    except (WorkerDied, TimeoutError, CannotPlace) as e:
        if isinstance(e, WorkerDied) and e.code is not None and e.code < 0:
            # The trial ends on a worker's signal: the campaign names it, and tells an out-of-memory kill (training.failure).
            write_failure(TrialConfig.from_file(args.config).trial_dir, signal_failure(-e.code, None, e.pid))
        print(f"elastic agent: {e}; ending the trial's other processes", file=sys.stderr, flush=True)
        agent.kill_all()
        agent.write_state("failed")
        return FAILED
    finally:
        if agent.zygote is not None:
            agent.zygote.close()  # waited for: nothing of the trial outlives its agent's exit


if __name__ == "__main__":
    sys.exit(main())
