"""The zygote forks children that run a module's main as `python -m` would, reports their
exit codes, and refuses to fork when forking would not be safe."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from training.zygote import Zygote, ZygoteGone

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
        with pytest.raises(ZygoteGone, match="more than one thread"):
            zygote.fork("zygote_child", [str(tmp_path / "out.json"), "0", "{fd0}"], dict(os.environ), tmp_path, fds=[devnull])
        with pytest.raises(ZygoteGone):  # and for every request after it: its starter starts processes itself
            zygote.fork("zygote_child", [], dict(os.environ), tmp_path)
    finally:
        os.close(devnull)
        zygote.close()
    assert not (tmp_path / "out.json").exists()
