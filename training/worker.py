"""A warm worker: one process that trains one-device trials one after another.

A trivial trial launched by torchrun spends seconds before its first step: the agent, the
interpreter, `import torch`, the rendezvous. For searches of many short trials that fixed
cost is most of the time. A warm worker pays it once: it imports torch, joins a process
group of one (an in-memory store: nothing listens), and then runs each trial it is sent in
the same process (`training.train.train_trial`, exactly what a torchrun worker runs),
with the trial's output in the trial's own train.log.

Protocol (tasks/trial.py drives it): one JSON line per trial on stdin, `{"config": path,
"log": path, "env": {name: value}, "unset": [name]}` (the campaign's environment changes
since the worker started, applied before the trial runs); one JSON line back on the file
descriptor given by `--reply-fd`, `{"code": 0}` or `{"code": 1}`. A trial that raises is
reported with code 1 and the worker exits (its state after an exception is not to be
trusted); end of stdin ends it.

A worker may be started before its device is leased (tasks.trial.prestart_warm_workers),
so it touches the device (CUDA, its core) only when its first trial comes, under that
trial's lease.

Forked, not started (`--zygote-fd N`): a campaign's warm workers come from one process that
imported torch and the trainer once (~2 s of CPU each time, most of a trivial trial's
cost) and forks a worker per request. Requests arrive on a SOCK_SEQPACKET socket: one
JSON message `{"env": {...}, "cwd": path}` with two file descriptors, the worker's stdin
and its reply pipe; the answer is `{"started": pid}`, and later `{"exited": pid, "code": c}`
when that worker ends (this process is its parent: only it can reap it and know its code).
Forking is safe here: after the imports this process has one thread and has not touched
CUDA (checked before the first fork), so a child starts from a clean state, applies its
device's environment (CUDA_VISIBLE_DEVICES, its cores) and only then opens the device.
A forked worker leads its own session (the campaign stops a trial by its process group)
and dies with the zygote, which ends when the campaign's end of the socket closes: at the
campaign's end, or its death.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import traceback

import torch
import torch.distributed as dist

from training.config import TrialConfig
from training.metrics import close_shared_sink, share_sink
from training.process import die_with_parent, skip_final_collection
from training.fence import stops_when_fenced, watch_lease
from training.train import pick_device, train_trial
from training.trainer import DistEnv


_device: torch.device | None = None  # set up at the first trial, under its lease


def _open_device() -> torch.device:
    """This worker's device and its process group of one, made at the first trial, once its
    fence watches the lease: a worker started ahead of its lease never touches the device."""
    global _device
    if _device is None:
        device = pick_device(0)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
        _device = device
    return _device


def run_one(request: dict) -> int:
    """Train the trial with this process's output going to its log."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(request["log"], "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    fence = None
    try:
        cfg = TrialConfig.from_file(request["config"])
        fence = watch_lease(cfg.lease)  # this trial's holder: a warm worker serves one after another
        with stops_when_fenced():
            train_trial(cfg, DistEnv(0, 1, 0), _open_device())
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        if fence is not None:
            fence.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        if _device is not None and _device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train one-device trials sent on stdin, one after another.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--reply-fd", type=int)
    group.add_argument("--zygote-fd", type=int, help="fork workers on request from this socket (see the module's doc)")
    args = parser.parse_args(argv)
    if args.zygote_fd is not None:
        serve_forks(socket.socket(fileno=args.zygote_fd))
        return
    die_with_parent()
    skip_final_collection()  # a campaign's end waits for its idle workers to exit
    share_sink()  # one MLflow sink for all the trials of this worker
    with os.fdopen(args.reply_fd, "w", buffering=1) as reply:
        for line in sys.stdin:
            request = json.loads(line)
            os.environ.update(request.get("env", {}))
            for name in request.get("unset", []):
                os.environ.pop(name, None)
            code = run_one(request)
            reply.write(json.dumps({"code": code}) + "\n")
            if code != 0:
                break
    close_shared_sink()  # every trial's metrics in MLflow before this worker is seen to end
    if _device is not None:
        dist.destroy_process_group()


def serve_forks(control: socket.socket) -> None:
    """The zygote's loop: fork a worker per request, report each one's exit; end when the
    campaign closes its side, or dies (the workers still running die with this process).
    Not the parent-death signal: it fires when the *thread* that started this process ends,
    and the campaign starts it from whichever thread first needs a worker."""
    if torch.cuda.is_initialized() or len(os.listdir("/proc/self/task")) > 1:
        raise SystemExit("training.worker --zygote-fd: CUDA or a second thread is up before the first fork; start workers instead")
    wake_read, wake_write = os.pipe()  # SIGCHLD wakes the select below
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([control, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
        for pid in list(children):  # reaped one by one: another child's status is not taken
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                control.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        if control not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
        if not message:
            os._exit(0)  # the workers get their parent-death signal; nothing else to tear down
        pid = os.fork()
        if pid == 0:
            _become_worker(json.loads(message), fds, closing=[control.fileno(), wake_read, wake_write])
        for fd in fds:
            os.close(fd)
        children.add(pid)
        control.send(json.dumps({"started": pid}).encode())


def _become_worker(request: dict, fds: list[int], closing: list[int]) -> None:
    """The forked child: a worker exactly as `--reply-fd` starts one, in its own session, with
    the environment and folder it was asked for. Never returns into the zygote's loop."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in closing:
            os.close(fd)
        stdin_fd, reply_fd = fds
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.close(devnull)
        sys.stdin = open(0, "r", closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        main(["--reply-fd", str(reply_fd)])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
