"""Errors in the user's terms (training/failure.py, training/files.py, tasks/trial.py).

- A full disk names what was being written, its file system's free space and the fix:
  tested on a real tmpfs of a few MiB that fills up (mounted here: the tests run as root; a
  test skips where mounting is not allowed), never by faking the write.
- A trial's process ended by a signal says the signal's name (killed by SIGKILL from outside,
  for real); an out-of-memory kill is told by the cgroup's oom_kill count before and after (a
  pure function over memory.events, and a real kill in a small memory cgroup of its own where
  one can be made).
- An exception raised in the user's own code fails its trial once (no retry), its last line
  shown, its traceback once in train.log; an infrastructure failure is retried.
(A lease store deleted or emptied while in use: tests/test_leases.py.)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from training.failure import (DISK_FULL, PROJECT, SIGNAL, USER, Failure, describe, exception_line, exit_description,
                              read_failure, signal_failure, user_packages, whose, write_failure)
from training.files import DiskFull, append_json_line, available_bytes, write_json_atomic

MiB = 1 << 20


# --- a disk that fills up for real ----------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A file system of the size asked (MiB), mounted in the test's folder: tmpfs, which needs
    root's mount. Skipped where mounting is not permitted (a container without CAP_SYS_ADMIN)."""
    mounted = []

    def make(size_mib: int) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(point)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"a tmpfs cannot be mounted here ({done.stderr.strip() or done.returncode}): the disk-full tests need one")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def fill(disk: Path) -> None:
    """Write until the file system refuses: nothing is left."""
    with open(disk / "filler", "wb") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"x" * 65536)
                f.flush()
    assert available_bytes(disk) == 0


def test_a_full_disk_names_the_file_its_free_space_and_the_fix(tiny_disk):
    disk = tiny_disk(1)
    fill(disk)
    record = disk / "runs" / "c" / "t" / "record.json"
    for write in (lambda: write_json_atomic(record, {"state": "running"}), lambda: append_json_line(disk / "log.jsonl", {"a": 1})):
        with pytest.raises(DiskFull) as caught:
            write()
        said = str(caught.value)
        assert said.startswith("disk full: cannot write ") and "(No space left on device)" in said, said
        assert f"0 B free of 1.0 MiB on the file system at {disk}" in said, said
        assert "free some space there, or set tracking.runs_dir to a folder on a file system with room" in said, said
        assert caught.value.errno == errno.ENOSPC and isinstance(caught.value, OSError)  # `except OSError` still catches it
    assert str(record) in said.replace(str(disk / "log.jsonl"), str(record))
    assert not any(p.name.startswith(".record.json.") for p in (disk / "runs" / "c" / "t").glob("*"))  # no half-written file left


def test_a_quota_exceeded_is_said_as_such():
    said = str(DiskFull("/home/u/runs/c/t/result.json", errno.EDQUOT))
    assert said.startswith("disk quota exceeded: cannot write /home/u/runs/c/t/result.json (Disk quota exceeded)")
    assert "your quota on it is used up" in said


def test_a_checkpoint_that_finds_no_room_says_so_and_gives_its_room_back(tiny_disk):
    import torch

    from training.checkpoint import Checkpointer

    disk = tiny_disk(1)
    checkpoints = disk / "t" / "checkpoints"
    saver = Checkpointer(checkpoints, keep=2, rank=0, world_size=1)
    with pytest.warns(UserWarning, match="single process"), pytest.raises(DiskFull) as caught:
        saver.save(1, {"trainer": {"weights": torch.zeros(MiB // 2)}})  # 2 MiB of float32 on a 1 MiB disk
    said = str(caught.value)
    assert said.startswith(f"disk full: cannot write the checkpoint {checkpoints / '.tmp-step-00000001'} (No space left on device); ")
    assert f"free of 1.0 MiB on the file system at {disk}" in said, said
    assert list(checkpoints.iterdir()) == [] and available_bytes(disk) > MiB * 9 // 10  # the half-written one is gone


def test_a_log_line_that_finds_no_room_while_a_checkpoint_fills_the_disk_names_the_checkpoint(tiny_disk):
    """A background save filled the disk; the training thread's print found no room first. The
    failure names the checkpoint, and its half-written folder goes, so the record fits."""
    from training.failure import DISK_FULL, failures_recorded, read_failure

    disk = tiny_disk(1)
    trial = disk / "runs" / "c" / "t"
    half = trial / "checkpoints" / ".tmp-step-00000020"
    half.mkdir(parents=True)
    fill(half)
    with pytest.raises(OSError), failures_recorded(trial, 0):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a print to the log: no file named
    failure = read_failure(trial)
    assert failure is not None and failure.kind == DISK_FULL, failure
    assert failure.line.startswith(f"disk full: cannot write the checkpoint {half} (No space left on device); "), failure.line
    assert f"0 B free of 1.0 MiB on the file system at {disk}" in failure.line
    assert not half.exists()


# --- whose code raised ----------------------------------------------------------------------------


USER_CODE = '''
import torch


def index_out_of_bounds():
    return torch.arange(10)[10]


def through_torch():
    return torch.nn.functional.cross_entropy(torch.zeros(2, 3), torch.tensor([0, 5]))


def calls(fn):
    return fn()
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "code.py").write_text(textwrap.dedent(USER_CODE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    import importlib

    return importlib.import_module("mylab.code")


def raised(fn):
    try:
        fn()
    except Exception as e:
        return e
    raise AssertionError("did not raise")


def test_an_exception_in_the_users_code_is_theirs_and_says_its_last_line(user_module):
    failure = describe(raised(user_module.index_out_of_bounds), rank=0)
    assert failure.kind == USER and not failure.retried
    assert failure.line == "IndexError: index 10 is out of bounds for dimension 0 with size 10 (mylab/code.py:6, in index_out_of_bounds)"
    # Raised inside torch, called from the user's code: the user's (torch's frames are skipped).
    failure = describe(raised(user_module.through_torch))
    assert failure.kind == USER and failure.where == "mylab/code.py:10, in through_torch", failure
    # Our code called by theirs (a callback): decided by the innermost frame outside the library.
    from training.files import read_bounded

    failure = describe(raised(lambda: user_module.calls(lambda: read_bounded(Path("/"), 10))))
    assert failure.kind == PROJECT and failure.retried and "training/files.py:" in failure.where, failure


def test_a_package_installed_among_the_libraries_is_still_the_users_when_a_target_names_it():
    import json as installed  # stands for the user's package installed with pip: its frames are the library's...

    error = raised(lambda: installed.loads("{"))
    kind, where = whose(error)
    assert kind == USER and "test_failures.py" in where  # ...skipped: the caller's frame decides
    kind, where = whose(error, user_packages(["json.decoder:make_model"]))
    assert kind == USER and "json/decoder.py" in where  # ...unless a target of the trial names the package


def test_an_error_of_ours_raised_from_the_users_is_the_users(user_module):
    from training.workload import WorkloadError

    def build():
        try:
            user_module.index_out_of_bounds()
        except IndexError as e:
            raise WorkloadError("model.target: mylab.code:index_out_of_bounds raised") from e

    import training.workload as workload  # an error raised in the project's frame, caused by the user's

    error = raised(lambda: exec(compile("build()", workload.__file__, "exec"), {"build": build}))
    assert whose(error)[0] == USER


def test_a_data_loader_workers_exception_is_told_by_its_own_traceback():
    """torch raises a DataLoader worker's exception again in the trainer, its traceback as text."""
    text = ("Caught IndexError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
            '  File "/usr/lib/python3/site-packages/torch/utils/data/_utils/worker.py", line 349, in _worker_loop\n'
            "    data = fetcher.fetch(index)\n"
            '  File "/home/me/lab/data.py", line 12, in __getitem__\n    return self.x[i + 100]\n'
            "IndexError: index 110 is out of bounds for axis 0 with size 100\n")
    error = IndexError(text)
    assert exception_line(error) == "IndexError: index 110 is out of bounds for axis 0 with size 100"
    assert whose(error) == (USER, "/home/me/lab/data.py:12, in __getitem__")


def test_the_first_failure_of_a_segment_is_kept(tmp_path):
    first = Failure(USER, "IndexError: boom (lab.py:1, in f)", "IndexError", rank=1)
    assert write_failure(tmp_path, first)
    assert not write_failure(tmp_path, Failure(PROJECT, "RuntimeError: Connection closed by peer", "RuntimeError", rank=0))
    assert read_failure(tmp_path) == first  # the peer's error after it does not hide why
    assert [p.name for p in tmp_path.iterdir()] == ["failure.json"]


# --- signals and the out-of-memory killer ---------------------------------------------------------


def test_a_negative_exit_code_is_said_as_its_signal():
    from tasks.trial import failure_reason

    assert exit_description(-9) == "killed by SIGKILL" and exit_description(-11) == "killed by SIGSEGV"
    assert exit_description(1) == "exited with code 1"
    assert failure_reason(-9, None) == "killed by SIGKILL"
    assert failure_reason(-15, None, oom=True) == "killed by SIGTERM"  # only a SIGKILL is the OOM killer's
    assert failure_reason(1, signal_failure(9, 0, 4242)) == "rank 0 (pid 4242) killed by SIGKILL"
    assert failure_reason(-9, None, oom=True, peak_bytes=int(3.25 * (1 << 30))) == \
        "killed by the out-of-memory killer (peak memory 3.2 GiB)"
    assert failure_reason(1, signal_failure(9, 1, 77), oom=True) == "rank 1 (pid 77) killed by the out-of-memory killer"
    assert failure_reason(1, Failure(DISK_FULL, "disk full: cannot write x"), oom=True) == "disk full: cannot write x"


V2_EVENTS = "low 0\nhigh 0\nmax 12\noom 1\noom_kill {}\noom_group_kill 0\n"
V1_OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill {}\n"


@pytest.mark.parametrize("events", [V2_EVENTS, V1_OOM_CONTROL], ids=["cgroup v2 memory.events", "cgroup v1 memory.oom_control"])
def test_an_out_of_memory_kill_is_told_by_the_cgroups_count_before_and_after(events):
    from tasks.trial import oom_kill_count, oom_killed

    assert oom_kill_count(events.format(3)) == 3
    assert oom_killed(events.format(3), events.format(4))
    assert not oom_killed(events.format(4), events.format(4))
    assert not oom_killed(None, events.format(4)) and not oom_killed(events.format(0), None)  # unreadable: no evidence
    assert oom_kill_count("oom_group_kill 2\n") is None


def launched(monkeypatch, tmp_path: Path, command: list[str], env: dict | None = None, trial_id: str = "t"):
    """run_trial's task body on `command` as the trial's launch (a real process, its own group)."""
    from tasks import trial as trial_module
    from training.config import TrialConfig

    trial_dir = tmp_path / trial_id
    trial_dir.mkdir(exist_ok=True)
    cfg = TrialConfig(trial_id=trial_id, seed=0, model={"name": "mlp"}, data={"path": "x"}, steps=10, batch_size=1, lr=0.1,
                      trial_dir=str(trial_dir))
    plan = trial_module.LaunchPlan(command, env or {}, tmp_path, trial_dir / "trial.json", trial_dir / "train.log")
    monkeypatch.setattr(trial_module, "plan_launch", lambda *a, **k: plan)
    trial_module.accept_launches()
    return cfg, trial_dir


def run_until(cfg, tmp_path, then) -> BaseException:
    """Run the trial, call `then()` beside it, and give back what the task raised."""
    from tasks import trial as trial_module

    side = threading.Thread(target=then, daemon=True)
    side.start()
    with pytest.raises(trial_module.TrialFailed) as caught:
        trial_module.run_trial.fn(cfg, [], str(tmp_path))
    side.join(timeout=60)
    return caught.value


def wait_for(condition, timeout_s: float = 60.0, what: str = "it"):
    deadline = time.time() + timeout_s
    while not (found := condition()):
        assert time.time() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.02)
    return found


def retried(error: BaseException) -> bool:
    from prefect.states import Failed

    from tasks.trial import _retried_if_infrastructure

    return _retried_if_infrastructure(None, None, Failed(data=error))


def test_a_trial_process_killed_by_sigkill_from_outside_says_so(tmp_path, monkeypatch):
    from tasks import trial as trial_module
    from tasks.records import read_trial_record

    cfg, trial_dir = launched(monkeypatch, tmp_path, [sys.executable, "-c", "import time; time.sleep(120)"])
    kill = lambda: os.kill(wait_for(lambda: trial_module.trial_process_groups("t"), what="the launch")[0], signal.SIGKILL)
    error = run_until(cfg, tmp_path, kill)
    assert error.summary == "trial t failed: killed by SIGKILL", str(error)
    record = read_trial_record(trial_dir)
    assert record.state == "failed" and record.reason == "killed by SIGKILL" and record.exit_code == -9
    assert retried(error)  # a signal is an infrastructure failure: retried once from the last checkpoint


SLEEPER = '''
import os, sys, time
from pathlib import Path

Path(sys.argv[sys.argv.index("--config") + 1]).with_name("worker.pid").write_text(str(os.getpid()))
time.sleep(120)
'''


def test_a_torchrun_worker_killed_by_sigkill_is_named_by_its_launcher(tmp_path, monkeypatch):
    """torchrun exits 1 whatever ended its worker: training/launch.py records the signal for
    the campaign, and says it in one line instead of a traceback of torchrun's own."""
    from tasks.records import read_trial_record
    from training.launch import launch_env

    (tmp_path / "sleeper.py").write_text(textwrap.dedent(SLEEPER))
    config = tmp_path / "t" / "trial.json"
    command = [sys.executable, "-m", "training.launch", "--standalone", "--nproc-per-node=1", "-m", "sleeper", "--config", str(config)]
    cfg, trial_dir = launched(monkeypatch, tmp_path, command, launch_env())
    pid_file = trial_dir / "worker.pid"
    pid = []
    kill = lambda: (pid.append(int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), what="the worker"))),
                    os.kill(pid[0], signal.SIGKILL))
    error = run_until(cfg, tmp_path, kill)
    reason = f"rank 0 (pid {pid[0]}) killed by SIGKILL"
    assert error.summary == f"trial t failed: {reason}", str(error)
    assert read_trial_record(trial_dir).reason == reason and read_failure(trial_dir).kind == SIGNAL
    log = (trial_dir / "train.log").read_text()
    assert f"training.launch: sleeper failed: {reason}" in log and "Traceback" not in log, log
    assert retried(error)


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int):
    """A memory cgroup of its own under this process's, limited to `limit_bytes` (v1's
    memory.limit_in_bytes, or v2's memory.max); skipped where one cannot be made and joined."""
    from tasks.trial import oom_events_file

    events = oom_events_file(os.getpid())
    if events is None:
        pytest.skip("no memory cgroup readable here")
    child = events.parent / f"campaign-test-oom-{os.getpid()}"
    try:
        child.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup under {events.parent} ({e.strerror})")
    try:
        try:
            limit = child / ("memory.limit_in_bytes" if events.name == "memory.oom_control" else "memory.max")
            limit.write_text(str(limit_bytes))
            probe = subprocess.run(["sh", "-c", f"echo $$ > {child / 'cgroup.procs'}"], capture_output=True, text=True)
            if probe.returncode != 0:
                raise OSError(errno.EPERM, probe.stderr.strip())
        except OSError as e:
            pytest.skip(f"cannot limit or join a memory cgroup at {child} ({e})")
        yield child
    finally:
        for _ in range(50):  # its last process may still be on its way out
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.1)


HOG = "import time\nheld = []\nwhile True:\n    held.append(b'x' * (4 << 20))\n    time.sleep(0.05)\n"


def test_a_real_out_of_memory_kill_is_said_as_such_with_the_peak_memory(tmp_path, monkeypatch):
    """A trial process that joins a cgroup of 96 MiB and allocates 4 MiB every 50 ms: the
    kernel's OOM killer ends it (in that cgroup only: nothing else on the machine is at risk)."""
    from tasks import trial as trial_module
    from tasks.records import read_trial_record

    monkeypatch.setattr(trial_module, "MEMORY_POLL_S", 0.05)
    with memory_cgroup(96 * MiB) as cgroup:
        command = ["sh", "-c", f'echo $$ > {cgroup / "cgroup.procs"} && exec {sys.executable} -c "{HOG}"']
        cfg, trial_dir = launched(monkeypatch, tmp_path, command)
        error = run_until(cfg, tmp_path, lambda: None)
    reason = read_trial_record(trial_dir).reason
    assert reason.startswith("killed by the out-of-memory killer (peak memory ") and reason.endswith(" MiB)"), (reason, str(error))
    peak = float(reason.split("peak memory ")[1].split()[0])
    assert 40 <= peak <= 128, reason  # resident memory counts the shared libraries the cgroup may not be charged for
    assert error.summary == f"trial t failed: {reason}"


# --- the campaign: retried or not -----------------------------------------------------------------


def test_user_code_and_full_disks_are_not_retried_infrastructure_is():
    from tasks.trial import TrialDiskFull, TrialFailed, TrialRaised, TrialStalled

    assert not retried(TrialRaised("trial t failed: IndexError: boom"))
    assert not retried(TrialDiskFull("trial t failed: disk full: cannot write x"))
    assert not retried(DiskFull("/runs/c/t/record.json"))  # the campaign's own record, on a full disk
    assert not retried(TrialStalled("trial t stalled at step 3 for 20 s"))
    assert retried(TrialFailed("trial t failed: killed by SIGKILL"))
    assert retried(TrialFailed("trial t failed: RuntimeError: Connection closed by peer (training/trainer.py:562, in train)"))


def launch_campaign(tmp_path: Path, name: str, spec: dict) -> tuple[subprocess.CompletedProcess, str]:
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"campaign": {"name": name}, **spec}))
    launch = subprocess.run([sys.executable, "-m", "flows.cli", "launch", "params.yaml", "--no-live"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"})
    return launch, launch.stdout + launch.stderr


@pytest.mark.slow
@pytest.mark.parametrize("warm", [False, True], ids=["torchrun", "warm worker"])
def test_an_exception_in_the_users_model_fails_its_trial_once_saying_its_last_line(tmp_path, digits_npz, warm):
    from conftest import campaign_cli
    from tasks.records import campaign_status, read_trial_record
    from training.layout import trial_files
    from user_workload import PACKAGE, write_package

    write_package(tmp_path)
    runs = tmp_path / "runs"
    launch, output = launch_campaign(tmp_path, "oops", {
        "data": {"path": str(digits_npz)}, "model": {"target": f"{PACKAGE}.nets:raises_at", "kwargs": {"step": 3}},
        "training": {"steps": 30, "batch_size": 16, "lr": 0.05, "checkpoint_every": 10, "eval_every": 30},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1, "warm_workers": warm},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(runs), "summary": str(tmp_path / "s.json")},
    })
    assert launch.returncode != 0, output[-3000:]
    [status] = campaign_status(runs, "oops")
    line = "IndexError: index 10 is out of bounds for dimension 0 with size 10"
    assert status.state == "failed" and status.reason.startswith(f"{line} ({PACKAGE}/nets.py:"), (status, output[-3000:])
    assert status.reason.endswith(", in forward)"), status.reason
    assert read_trial_record(runs / "oops" / status.trial_id).attempts == 1  # not retried
    log = trial_files(runs / "oops" / status.trial_id).log.read_text()
    assert log.count("Traceback (most recent call last)") == 1 and log.count(line) == 1, log[-4000:]
    # The flow's event (the live view's line) is the exception's own line, not a cut of a traceback...
    assert f"trial {status.trial_id} failed: {line} ({PACKAGE}/nets.py:" in output, output[-3000:]
    assert f'{PACKAGE}/nets.py", line' not in output, output[-3000:]  # ...whose frames stay in train.log
    shown = campaign_cli("status", "oops", "--runs-dir", str(runs), cwd=tmp_path)
    assert f"trial {status.trial_id} failed: {line}" in " ".join(shown.stdout.split()), shown.stdout + shown.stderr


@pytest.mark.slow
def test_a_trial_whose_disk_fills_up_fails_once_saying_where_and_how_much_is_free(tmp_path, digits_npz, tiny_disk):
    """The campaign's runs folder on a 3 MiB file system; the trial's checkpoint (a model of
    ~2.6 MB, its momentum as much again) does not fit."""
    from conftest import campaign_cli
    from tasks.records import campaign_status, read_trial_record
    from user_workload import PACKAGE, write_package

    disk = tiny_disk(3)
    write_package(tmp_path)
    runs = disk / "runs"
    launch, output = launch_campaign(tmp_path, "full", {
        "data": {"path": str(digits_npz)}, "model": {"target": f"{PACKAGE}.nets:make", "kwargs": {"width": 1024}},
        "training": {"steps": 30, "batch_size": 16, "lr": 0.05, "checkpoint_every": 10, "eval_every": 30},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1, "warm_workers": False},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(runs), "summary": str(tmp_path / "s.json")},
    })
    assert launch.returncode != 0, output[-3000:]
    [status] = campaign_status(runs, "full")
    checkpoint = runs / "full" / status.trial_id / "checkpoints" / ".tmp-step-00000010"
    assert status.state == "failed" and status.reason.startswith(
        f"disk full: cannot write the checkpoint {checkpoint} (No space left on device); "), (status, output[-3000:])
    assert f"free of 3.0 MiB on the file system at {disk}: free some space there, or set tracking.runs_dir" in status.reason
    assert read_trial_record(runs / "full" / status.trial_id).attempts == 1  # not retried: it would fill the disk again
    assert not checkpoint.exists()  # its room given back
    assert f"trial {status.trial_id} failed: disk full: cannot write the checkpoint" in output, output[-3000:]
    shown = campaign_cli("status", "full", "--runs-dir", str(runs), cwd=tmp_path)
    assert f"trial {status.trial_id} failed: disk full: cannot write the checkpoint" in " ".join(shown.stdout.split())
