"""The zygote forks children that run a module's main as `python -m` would, reports their
exit codes, and refuses to fork when forking would not be safe."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from training.zygote import Zygote, ZygoteCannotFork, ZygoteGone

REPO = Path(__file__).resolve().parents[1]

CHILD = '''
import json, os, sys
from pathlib import Path

def main(args):
    out = Path(args[0])
    with os.fdopen(int(args[2]), "w") as passed:
        passed.write("through the passed pipe")
    out.write_text(json.dumps({"env": os.environ.get("ZYGOTE_TEST"), "cwd": os.getcwd(),
                               "name": Path("/proc/self/comm").read_text().strip(), "sid": os.getsid(0) == os.getpid(),
                               "stdin": sys.stdin.read()}))
    return int(args[1])
'''


def start(tmp_path: Path, preload: list[str], **kwargs) -> Zygote:
    (tmp_path / "zygote_child.py").write_text(textwrap.dedent(CHILD))
    (tmp_path / "zygote_thread.py").write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    return Zygote(preload, tmp_path, env, sys.executable, **kwargs)


def test_a_child_runs_the_modules_main_in_its_own_environment_and_its_code_is_reported(tmp_path):
    zygote = start(tmp_path, ["zygote_child"], new_session=True)
    try:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        stdin_read, stdin_write = os.pipe()
        pipe_read, pipe_write = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "ZYGOTE_TEST": "its own"}
        child = zygote.fork("zygote_child", [str(tmp_path / "out.json"), "7", "{fd1}"], env, elsewhere,
                            fds=[stdin_read, pipe_write], stdin=True, name="test child")
        os.close(stdin_read)
        os.close(pipe_write)
        with os.fdopen(stdin_write, "w") as stdin:
            stdin.write("to its stdin")
        assert child.wait(timeout=60) == 7
        with os.fdopen(pipe_read) as passed:
            assert passed.read() == "through the passed pipe"
        seen = json.loads((tmp_path / "out.json").read_text())
        assert seen == {"env": "its own", "cwd": str(elsewhere), "name": "test child", "sid": True, "stdin": "to its stdin"}
        devnull = os.open(os.devnull, os.O_WRONLY)
        second = zygote.fork("zygote_child", [str(tmp_path / "out2.json"), "0", "{fd0}"], env, tmp_path, fds=[devnull])
        os.close(devnull)  # the child has its own copy
        assert second.wait(timeout=60) == 0 and child.returncode == 7  # each child's own code
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0


def test_a_zygote_with_a_second_thread_refuses_to_fork_and_says_why(tmp_path):
    zygote = start(tmp_path, ["zygote_thread"])
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        # Its starter says so once, as a warning (under a live table it goes to campaign.log):
        # else every process is silently seconds slower to start.
        with pytest.raises(ZygoteGone, match="more than one thread"), pytest.warns(ZygoteCannotFork, match="more than one thread"):
            zygote.fork("zygote_child", [str(tmp_path / "out.json"), "0", "{fd0}"], dict(os.environ), tmp_path, fds=[devnull])
        with pytest.raises(ZygoteGone):  # and for every request after it: its starter starts processes itself
            zygote.fork("zygote_child", [], dict(os.environ), tmp_path)
    finally:
        os.close(devnull)
        zygote.close()
    assert not (tmp_path / "out.json").exists()


def _children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _described(pid: int) -> tuple[str, bytes]:
    return Path(f"/proc/{pid}/comm").read_text().strip(), Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["finishes", "killed"])
def test_torchruns_workers_are_forked_from_one_zygote_that_ends_with_the_launch(tmp_path, digits_npz, ending):
    """`training.launch` forks torchrun's workers from one zygote (training/launch.py): a
    held two-rank trial runs as the launch, its zygote, and two children of the zygote named
    by their rank; no worker imports torch on its own. Released, the trial ends with its
    result and leaves no process; with its launch killed outright, neither zygote nor worker
    outlives it."""
    import signal
    import subprocess

    from conftest import running_state, trainer_rank, wait_for
    from training.config import TrialConfig
    from training.launch import worker_name
    from training.layout import trial_files
    from training.progress import read_progress

    trial_dir = tmp_path / "trial"
    cfg = TrialConfig(trial_id="forked", seed=3, model={"name": "mlp", "width": 8}, data={"path": str(digits_npz)}, steps=40, logical_ranks=2,
                      batch_size=16, lr=0.05, eval_every=40, checkpoint_every=20, trial_dir=str(trial_dir), hold_at_step=10)
    trial_files(trial_dir).hold.parent.mkdir(parents=True)
    trial_files(trial_dir).hold.touch()
    (trial_dir / "trial.json").write_text(cfg.to_json())
    launch = subprocess.Popen([sys.executable, "-m", "training.launch", "--standalone", "--nproc-per-node=2", "-m", "training.train",
                               "--config", str(trial_dir / "trial.json")], cwd=REPO, stdout=open(tmp_path / "launch.log", "wb"),
                              stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1", "CAMPAIGN_CPU_CORES": "0,0"})

    def held() -> bool:
        assert launch.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
        progress = read_progress(trial_dir)
        return progress is not None and progress.state == "held"

    wait_for(held, 120, "the trial held")
    (zygote,) = [pid for pid in _children(launch.pid) if b"training.zygote" in _described(pid)[1]]
    workers = sorted(_children(zygote), key=lambda pid: _described(pid)[0])
    assert [_described(pid)[0] for pid in workers] == [worker_name(0), worker_name(1)]
    assert [trainer_rank(pid) for pid in [zygote, *workers]] == [None, 0, 1]
    assert not [pid for pid in _children(launch.pid) if b"training.train\0--config" in _described(pid)[1]]  # none started anew

    if ending == "finishes":
        trial_files(trial_dir).hold.unlink()
        assert launch.wait(timeout=120) == 0, (tmp_path / "launch.log").read_text()[-3000:]
        assert (trial_dir / "result.json").exists()
    else:
        launch.send_signal(signal.SIGKILL)
        launch.wait()
    wait_for(lambda: all(running_state(pid) is None for pid in [zygote, *workers]), 30, "the zygote and its workers gone")


def test_what_a_process_keeps_for_its_life_is_frozen_and_the_collector_back_on():
    """training.process.imports_without_gc, as a zygote's preload uses it: no collection during
    the block, everything made in it frozen after (never walked again), the collector on again."""
    import gc

    from training.process import imports_without_gc

    assert gc.isenabled()
    before = gc.get_freeze_count()
    try:
        with imports_without_gc():
            assert not gc.isenabled()
            kept = [[i] for i in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()  # this test process's collector as it was


def test_a_preload_named_with_a_function_is_imported_and_called_before_the_first_fork(tmp_path):
    """`module:function` (the spare zygote's `training.pruning:import_storage`): the children
    find what the call made, without making it themselves."""
    (tmp_path / "zygote_made.py").write_text(textwrap.dedent('''
        import os
        made = []

        def make():
            made.append(os.getpid())
    '''))
    (tmp_path / "zygote_ask.py").write_text(textwrap.dedent('''
        import json, os, sys
        from pathlib import Path

        def main(args):
            import zygote_made
            Path(args[0]).write_text(json.dumps({"made_by": zygote_made.made, "me": os.getpid()}))
            return 0
    '''))
    zygote = start(tmp_path, ["zygote_made:make"])
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
        child = zygote.fork("zygote_ask", [str(tmp_path / "out.json")], env, tmp_path)
        assert child.wait(timeout=60) == 0
        seen = json.loads((tmp_path / "out.json").read_text())
        assert seen["made_by"] == [zygote.proc.pid] != [seen["me"]]  # called once, in the zygote, before the fork
    finally:
        zygote.close()
