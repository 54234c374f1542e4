"""Tie a process's life to its parent's, and stop whole process groups.

torchrun starts each worker in a session of its own, so killing torchrun (or the campaign
that launched it) leaves the workers running on a device whose lease is then reclaimed and
given to another trial. PR_SET_PDEATHSIG makes the kernel signal a child when its parent
dies, which closes that gap at both levels: campaign -> torchrun -> workers.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import gc
import os
import signal
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux only)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux: nothing to do
        return
    libc.prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


STACKS_SIGNAL = signal.SIGUSR1  # a trial process that gets it writes its Python stacks (tasks/watchdog.py sends it)


def dump_stacks_on_request() -> None:
    """STACKS_SIGNAL makes this process write every thread's Python stack to its stderr (a
    trial's train.log), and go on: what the campaign's watchdog asks of a stalled trial
    before it stops it. faulthandler writes from the signal handler itself, so a process
    stuck in C (a collective, a lock, a sleep) answers too. Kept across fork (a zygote's
    children, a loader's workers); to a process that did not ask for it the signal is fatal,
    so the watchdog sends it only to those that catch it."""
    faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)


def name_process(name: str) -> None:
    """This process's name as `ps -o comm`, `top` and /proc/<pid>/comm show it (15 bytes at
    most; Linux only): a forked worker's command line is its zygote's, so this tells them apart."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def skip_final_collection() -> None:
    """At exit, freeze what is alive so the interpreter's last garbage collection passes it by.

    A process that imported torch, MLflow or Prefect otherwise spends seconds (measured: 2.3 s
    of `campaign launch`'s exit on two busy cores, in `gc_collect_main`) walking a heap the
    operating system is about to free whole. Called first thing, its hook runs last, after
    every other atexit hook has flushed what it holds; open files are closed by refcount as
    always (freezing only spares them the cycle collector)."""
    atexit.register(gc.freeze)


@contextlib.contextmanager
def imports_without_gc():
    """Import (and build) what the process keeps for its life without the cycle collector, then
    freeze it. Python's collector runs every few hundred new objects, and an import of torch,
    Prefect or MLflow makes millions: its passes (the oldest generation's walk the whole growing
    heap) took 10 to 18 % of the import's CPU here (`import training.train, training.worker,
    prefect.flow_engine, flows.run.campaign`: 3.31-3.47 CPU-s, 2.72-3.05 with it off). Frozen, what was imported is never walked
    again, in this process nor in a child forked from it (a zygote's workers: Python's own
    advice for a process that forks, which also keeps their pages shared). What becomes
    garbage in the block is freed by reference counting as always; only cycles made in it stay.
    Used by a zygote, the campaign's hub and `campaign launch` (tests/test_elastic.py,
    test_live_resize.py, test_workload.py and test_watch.py side by side: 7.3 % less CPU)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def stop_process_groups(groups, grace_s: float) -> None:
    """SIGTERM each process group, SIGKILL what is left after `grace_s`; returns once they
    are gone (or ten seconds after the kill)."""
    for pgid in groups:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.time() + grace_s
    for pgid in groups:
        while group_alive(pgid) and time.time() < deadline:
            time.sleep(0.05)
        if group_alive(pgid):
            signal_group(pgid, signal.SIGKILL)
            while group_alive(pgid) and time.time() < deadline + 10:
                time.sleep(0.05)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    """Any process of the group still running (zombies, already dead, do not count)."""
    return any(group == pgid for _, group in process_table().values())


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process that still runs (not a zombie)."""
    table = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            table[int(proc.name)] = (int(fields[1]), int(fields[2]))
    return table


def processes_marked(name: str, value: str) -> dict[int, bytes]:
    """pid -> command line of every process (but this one) whose environment holds `name=value`.

    A mark in the environment follows a process's descendants wherever they go: a daemon that
    left its process group and session (fork + setsid, as some data loaders and tokenizer
    servers do) still carries it, as it carries every variable it inherited (the way Jenkins
    finds the processes a build left behind). /proc/<pid>/environ is the environment the
    process started with, or its parent's where it was forked without a new program."""
    needle = f"{name}={value}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                found[int(proc.name)] = (proc / "cmdline").read_bytes()
        except OSError:
            continue
    return found


def end_processes(pids, grace_s: float) -> None:
    """SIGTERM each process, SIGKILL those still running after `grace_s`."""
    pids = list(pids)
    for pid in pids:
        signal_process(pid, signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(process_running(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if process_running(pid):
            signal_process(pid, signal.SIGKILL)


def signal_process(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def process_running(pid: int) -> bool:
    """Whether `pid` is a process that may still run code (a zombie, already dead, does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X")
