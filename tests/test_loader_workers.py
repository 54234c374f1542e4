"""DataLoader workers never outlive the trainer that feeds them, however it ends."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap

from conftest import REPO

TRAINER = textwrap.dedent("""
    import sys, time, torch
    from multiprocessing import forkserver
    from torch.utils.data import DataLoader, TensorDataset
    from training.batches import loader_options

    if __name__ == "__main__":
        data = TensorDataset(torch.arange(1000.0), torch.arange(1000.0))
        batches = iter(DataLoader(data, batch_size=10, **loader_options(torch.device("cpu"), 2)))
        next(batches)
        pids = [w.pid for w in batches._workers] + [forkserver._forkserver._forkserver_pid]
        print(" ".join(map(str, pids)), flush=True)
        time.sleep(600)  # killed long before
""")


def wait_exited(pid: int, timeout: float) -> bool:
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([handle], [], [], timeout)[0])  # readable once the process has exited
    finally:
        os.close(handle)


def test_a_killed_trainer_takes_its_loader_workers_and_their_fork_server_with_it(tmp_path):
    """Workers come from a fork server (a fork of the threaded trainer can deadlock); their
    parent is then the server, so only our watch ends them when the trainer is SIGKILLed."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        pids = [int(p) for p in trainer.stdout.readline().split()]
        assert len(pids) == 3, pids  # two workers and the server
        assert not any(wait_exited(pid, 0) for pid in pids)  # all running while the trainer is
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    still = [pid for pid in pids if not wait_exited(pid, 30)]
    for pid in still:
        os.kill(pid, signal.SIGKILL)  # leave nothing behind, then fail
    assert not still, f"left running after the trainer was killed: {still}"
