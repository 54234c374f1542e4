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
descriptor given by `--reply-fd`, `{"code": 0}` or `{"code": 1}` (with what a `next_trial`
hook adds: the trial it started next without waiting for stdin). A trial that raises is
reported with code 1 and the worker exits (its state after an exception is not to be
trusted); end of stdin ends it.

A worker may be started before its device is leased (tasks.trial.prestart_warm_workers),
so it touches the device (CUDA, its core) only when its first trial comes, under that
trial's lease.

Forked, not started: a campaign's warm workers are forked from one zygote
(training/zygote.py) that imported this module once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import IO, Callable, Iterator

import torch
import torch.distributed as dist

from training.config import TrialConfig
from training.failure import failures_recorded, targets_of, user_packages
from training.metrics import close_shared_sink, share_sink
from training.process import die_with_parent, dump_stacks_on_request, skip_final_collection
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
        # Whose failure it is, for the campaign's retry, before the traceback below (training.failure).
        with stops_when_fenced(), failures_recorded(cfg.trial_dir, 0, user_packages(targets_of(cfg))):
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


# After a trial ended with `code`: what the reply adds, and the request to run next without
# waiting for one on stdin (None: the next line of stdin). tasks/warm_worker.py gives one that
# passes the device on to the trial staged after it.
NextTrial = Callable[[dict, int], "tuple[dict, dict | None]"]


def serve(requests: Iterator[dict], reply: IO[str], next_trial: NextTrial | None = None) -> None:
    """Run each request's trial and answer it; the first that raises ends the loop."""
    request = next(requests, None)
    while request is not None:
        os.environ.update(request.get("env", {}))
        for name in request.get("unset", []):
            os.environ.pop(name, None)
        code = run_one(request)
        extra, following = next_trial(request, code) if next_trial is not None and code == 0 else ({}, None)
        reply.write(json.dumps({"code": code, **extra}) + "\n")
        if code != 0:
            break
        request = following if following is not None else next(requests, None)


def main(argv: list[str] | None = None, next_trial: NextTrial | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train one-device trials sent on stdin, one after another.")
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args(argv)
    die_with_parent()
    skip_final_collection()  # a campaign's end waits for its idle workers to exit
    dump_stacks_on_request()  # a stalled trial's stacks, to its log while it runs (stderr is that log then)
    share_sink()  # one MLflow sink for all the trials of this worker
    with os.fdopen(args.reply_fd, "w", buffering=1) as reply:
        serve((json.loads(line) for line in sys.stdin), reply, next_trial)
    close_shared_sink()  # every trial's metrics in MLflow before this worker is seen to end
    if _device is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
