"""Checkpoints through a DVC remote (tracking.dvc_remote): a trial resumes on a machine that
never saw its folder, from what the remote holds, and nothing unverified is loaded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import wait_for
from training.checkpoint import Checkpointer
from training.checkpoint_remote import CheckpointRemote, resolve_remote
from training.spec import SpecError, check_tracking, parse_spec


def save(checkpointer: Checkpointer, step: int) -> None:
    checkpointer.save(step, {"w": torch.full((4,), float(step)), "progress": {"step": step}})


def remote_at(tmp_path: Path) -> CheckpointRemote:
    return CheckpointRemote(str(tmp_path / "remote"), "camp/t1", keep=2)


def test_a_fresh_folder_resumes_from_the_remotes_newest_checkpoint(tmp_path):
    here = Checkpointer(tmp_path / "node-a", keep=2, rank=0, world_size=1, remote=remote_at(tmp_path))
    for step in (10, 20, 30):
        save(here, step)
    assert [e["step"] for e in remote_at(tmp_path).entries()] == [30, 20]  # the index keeps what the folder keeps

    elsewhere = Checkpointer(tmp_path / "node-b", keep=2, rank=0, world_size=1, remote=remote_at(tmp_path))  # never saw node-a
    state = {"w": torch.zeros(4), "progress": {"step": 0}}
    assert elsewhere.load_latest(state) == 30
    assert torch.equal(state["w"], torch.full((4,), 30.0))
    assert elsewhere.loaded == tmp_path / "node-b" / "step-00000030"


def test_what_the_remote_holds_is_not_sent_again(tmp_path):
    """Content-addressed, as DVC lays a remote out: pushing a checkpoint the remote already
    holds (a relaunch that saves the same step, a second node) writes no object."""
    here = Checkpointer(tmp_path / "node-a", keep=2, rank=0, world_size=1, remote=remote_at(tmp_path))
    save(here, 10)
    objects = tmp_path / "remote" / "files" / "md5"
    before = {f: f.stat().st_mtime_ns for f in objects.rglob("*") if f.is_file()}
    assert len(before) == 4  # .metadata, one shard, the manifest, and the tree
    remote_at(tmp_path).push(tmp_path / "node-a" / "step-00000010")
    assert {f: f.stat().st_mtime_ns for f in objects.rglob("*") if f.is_file()} == before


def test_a_corrupt_remote_checkpoint_is_refused_and_an_older_one_used(tmp_path, capsys):
    here = Checkpointer(tmp_path / "node-a", keep=2, rank=0, world_size=1, remote=remote_at(tmp_path))
    save(here, 10)
    save(here, 20)
    newest = remote_at(tmp_path).entries()[0]
    tree = json.loads((tmp_path / "remote" / "files" / "md5" / newest["tree"][:2] / newest["tree"][2:]).read_text())
    shard = next(e for e in tree if e["relpath"].endswith(".distcp"))
    target = tmp_path / "remote" / "files" / "md5" / shard["md5"][:2] / shard["md5"][2:]
    target.chmod(0o644)
    target.write_bytes(b"\0" * target.stat().st_size)  # same size, other bytes: only the manifest's sha256 tells

    elsewhere = Checkpointer(tmp_path / "node-b", keep=2, rank=0, world_size=1, remote=remote_at(tmp_path))
    assert elsewhere.latest() == tmp_path / "node-b" / "step-00000010"
    assert "step 20 refused" in capsys.readouterr().err
    assert not (tmp_path / "node-b" / "step-00000020").exists()


def test_an_unreachable_remote_leaves_training_to_its_own_folder(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    here = Checkpointer(tmp_path / "node-a", keep=2, rank=0, world_size=1,
                        remote=CheckpointRemote(str(tmp_path / "file" / "remote"), "camp/t1"))
    save(here, 10)  # the push fails, said; the checkpoint is whole here
    assert "pushing step-00000010 failed" in capsys.readouterr().err
    assert here.latest() == tmp_path / "node-a" / "step-00000010"


def test_the_spec_names_a_remote_it_cannot_write(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    raw = {"campaign": {"name": "r"}, "model": {"name": "mlp"}, "training": {"steps": 10, "batch_size": 8, "lr": 0.1},
           "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/m.db", "dvc_remote": str(tmp_path / "file" / "remote")}}
    with pytest.raises(SpecError, match=r"tracking\.dvc_remote: cannot write to the remote"):
        check_tracking(parse_spec(raw))
    raw["tracking"]["dvc_remote"] = str(tmp_path / "ok")
    check_tracking(parse_spec(raw))
    assert (tmp_path / "ok" / "index").is_dir() and not list((tmp_path / "ok" / "index").iterdir())  # the probe is gone


def test_a_remote_may_be_named_as_dvc_knows_it(tmp_path):
    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc" / "config").write_text("['remote \"ckpt\"']\n    url = ../shared/ckpt\n")
    assert resolve_remote("ckpt", tmp_path) == str((tmp_path / "shared" / "ckpt").resolve())
    assert resolve_remote("s3://bucket/ckpt", tmp_path) == "s3://bucket/ckpt"
    assert resolve_remote("nosuch", tmp_path) == str(Path("nosuch").resolve())  # not a remote's name: a folder


@pytest.mark.slow
def test_a_killed_trial_resumes_from_the_remote_on_a_machine_without_its_folder(tmp_path):
    """SIGKILL to the campaign while its trial holds at step 65 (checkpoints every 20, pushed
    to a directory remote); the runs folder is deleted, as on another machine; launching
    again pulls step 60 from the remote and finishes from there."""
    from test_function import launch_held_at_65, write_params

    write_params(tmp_path, "far", {"kwargs": {"every": 10, "save_every": 20}, "steps": 100},
                 tracking={"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "runs_dir": str(tmp_path / "runs"),
                           "summary": str(tmp_path / "s.json"), "dvc_remote": str(tmp_path / "remote")})
    proc, trial_dir = launch_held_at_65(tmp_path, tmp_path / "runs" / "far")
    # Step 60's push runs beside training: under load it may still be on its way at the hold.
    wait_for(lambda: any((tmp_path / "remote" / "index").rglob("step-00000060.json")) or proc.poll() is not None, 120, "step 60 on the remote")
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # Every process of the killed campaign (they work in its folder: the trial's, its metrics hub)
    # has ended before its folder goes, as on a machine that is gone.
    wait_for(lambda: not any(_works_in(p, tmp_path) for p in Path("/proc").glob("[0-9]*")), 60, "the campaign's processes to end")
    shutil.rmtree(tmp_path / "runs")  # another machine: no folder, no checkpoint, only the remote
    done = subprocess.run([sys.executable, "-m", "flows.cli", "launch", "params.yaml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((trial_dir / "result.json").read_text())
    assert result["steps"] == 100 and result["resumed_from_step"] == 60
    log = (trial_dir / "train.log").read_text()
    assert "pulled checkpoint step 60" in log and "resumed at step 60" in log


def _works_in(proc: Path, folder: Path) -> bool:
    """Whether the process runs in `folder` (its working folder) or names it on its command line."""
    try:
        return os.readlink(proc / "cwd").startswith(str(folder)) or str(folder).encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False


def _across_two_machines(rank: int, tmp: str, init: str, out) -> None:
    """One rank of a trial whose ranks' folders are on different machines (node-0, node-1)."""
    import torch.distributed as dist

    from training.manifest import latest_valid_checkpoint

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        root = Path(tmp) / f"node-{rank}"
        remote = CheckpointRemote(str(Path(tmp) / "remote"), "camp/t1", keep=2)
        writer = Checkpointer(root, keep=2, rank=rank, world_size=2, remote=remote, one_writer=True)
        writer.save(10, {"w": torch.full((4,), 10.0), "progress": {"step": 10}})
        whole = latest_valid_checkpoint(root)
        dist.barrier()
        reader = Checkpointer(root, keep=2, rank=rank, world_size=2, remote=remote, one_writer=True)
        state = {"w": torch.zeros(4), "progress": {"step": 0}}
        step = reader.load_latest(state)
        out.put((rank, str(whole) if whole else None, step, state["w"].tolist(), str(reader.loaded)))
    finally:
        dist.destroy_process_group()


def test_one_writer_puts_a_whole_checkpoint_on_rank_0s_machine_and_the_others_pull_it(tmp_path):
    """A trial across nodes without shared storage: rank 0 writes every replicated item, so its
    folder holds the whole (verified) checkpoint, which it pushes; rank 1, whose folder has
    none, pulls it into its own folder and loads from there (not from rank 0's path)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_across_two_machines, args=(rank, str(tmp_path), init, out)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    results = {}
    for _ in procs:
        rank, whole, step, weights, loaded = out.get(timeout=120)
        results[rank] = (whole, step, weights, loaded)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert results[0][0] == str(tmp_path / "node-0" / "step-00000010")  # whole on rank 0's machine
    assert results[1][0] is None  # nothing loadable was written on rank 1's
    for rank in (0, 1):
        assert results[rank][1:3] == (10, [10.0] * 4), results
        assert results[rank][3] == str(tmp_path / f"node-{rank}" / "step-00000010"), results
