"""torchrun with its rendezvous stores listening on 127.0.0.1 only (on one machine), or on
the node's own address ($CAMPAIGN_BIND_ADDR, for a trial that spans nodes), and its
workers forked from a zygote.

    python -m training.launch --standalone --nproc-per-node=2 -m training.train --config ...

takes torchrun's arguments unchanged (see training/loopback.py for why).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

from training.loopback import patch_torch_stores
from training.process import skip_final_collection
from training.zygote import Zygote, ZygoteGone

TRAINER = "training.train"


def launch_env() -> dict[str, str]:
    """What every trial process a campaign starts runs with, over the campaign's own
    environment (torchrun's, the elastic agent's, a warm worker's, and their zygotes')."""
    return {
        # gloo picks the first non-loopback interface unless told otherwise, and hangs on it here.
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "MASTER_ADDR": "127.0.0.1",
        "PYTHONUNBUFFERED": "1",
        # One thread: the zygotes fork only a process with one thread (and a trial's ranks share the cores).
        "OMP_NUM_THREADS": "1",
    }


def worker_name(local_rank: int | str) -> str:
    """A forked worker's process name (`ps -o comm`): its command line is its zygote's, and its
    /proc environ the zygote's too, so the name carries its rank."""
    return f"trainer-{local_rank}"


def fork_workers_from_a_zygote() -> None:
    """torchrun starts each worker as `python -u -m training.train ...`: a new interpreter that
    imports torch and the trainer first, as the trial starts and at every restart (a two-rank
    trial here: 5.8 CPU-s so, 4.0 forked). Here they are forked from one zygote (training/zygote.py) that imported
    them once, started with this agent's environment (torchrun's OMP_NUM_THREADS included) as
    the workers' would have been. Any other command, a worker whose output torchrun redirects,
    or a zygote that cannot fork (the CUDA driver loaded in it): started as torchrun starts it."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    popen = handler._popen
    zygote: Zygote | None = None

    def _popen(self, args: tuple, env: dict[str, str]):
        nonlocal zygote
        if tuple(args[:4]) == (sys.executable, "-u", "-m", TRAINER) and self._stdout is None and self._stderr is None:
            try:
                if zygote is None:
                    # Its children lead sessions of their own, as torchrun's workers do (it
                    # signals their groups); unbuffered output, as `-u` gives them. The zygote
                    # ends when this agent does, and its children with it.
                    zygote = Zygote([TRAINER], Path.cwd(), {**os.environ, "PYTHONUNBUFFERED": "1"}, new_session=True,
                                    output=None, serves=" ".join(args[3:]))
                    # Reaped here at the end (its children's CPU counted to this tree, not to init's).
                    atexit.register(zygote.close)
                return zygote.fork(TRAINER, list(args[4:]), env, Path.cwd(), name=worker_name(env.get("LOCAL_RANK", 0)))
            except ZygoteGone:
                pass
        return popen(self, args, env)

    handler._popen = _popen


def log_dir_removed_at_exit(argv: list[str]) -> None:
    """torchrun keeps its workers' error files in a log folder, by default a new
    /tmp/torchelastic_* it never removes: one per launch, so a campaign left a folder per
    trial start. Unless the command names one, the folder is made here and removed when the
    launch exits (not when it is killed outright); a worker's failure is printed before then."""
    if any(a == "--log-dir" or a.startswith(("--log-dir=", "--log_dir")) for a in argv[1:]):
        return
    folder = tempfile.mkdtemp(prefix="torchelastic_")
    argv[1:1] = ["--log-dir", folder]
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


def trial_dir_of(argv: list[str]) -> str | None:
    """The trial folder of the worker command's `--config` (training.config.TrialConfig), if any."""
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else arg[len("--config="):] if arg.startswith("--config=") else None
        if path:
            from training.config import TrialConfig

            try:
                return TrialConfig.from_file(path).trial_dir
            except Exception:  # an unreadable config: the worker's own error says so
                return None
    return None


def run_torchrun(argv: list[str]) -> None:
    """torchrun; a worker's failure ends it with one line, not a traceback of torchrun's own
    under the worker's (a failed trial's log held two per attempt): the worker printed its
    traceback already. A worker ended by a signal is recorded for the campaign
    (training.failure: `failure.json`), which names it (an out-of-memory kill, SIGKILL).
    Exit code 1, as torchrun's."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main()
    except ChildFailedError as e:
        from training.failure import exit_description, signal_failure, write_failure

        rank, first = e.get_first_failure()
        said = f"rank {rank} (pid {first.pid}) {exit_description(first.exitcode)}"
        if first.exitcode < 0 and (trial_dir := trial_dir_of(argv)) is not None:
            write_failure(trial_dir, signal_failure(-first.exitcode, rank, first.pid))
        print(f"training.launch: {e.name} failed: {said}" + (" (its traceback is above)" if first.exitcode > 0 else ""),
              file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    skip_final_collection()  # a trial's end is seen when torchrun has exited
    log_dir_removed_at_exit(sys.argv)
    patch_torch_stores()
    fork_workers_from_a_zygote()
    run_torchrun(sys.argv)
