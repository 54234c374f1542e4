"""DVC runs the pipeline in a fresh git repo: `dvc repro` twice (the second a no-op),
`dvc metrics show` reads the campaign summary, `dvc push` to a local remote works."""

from __future__ import annotations

import pytest

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from conftest import without_shared_prefect_server

pytestmark = pytest.mark.slow  # real campaigns, torchrun or elastic trials: `make test-fast` skips them

REPO = Path(__file__).resolve().parent.parent


def sh(cwd: Path, *cmd: str) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_dvc_repro_twice_metrics_and_push(tmp_path, monkeypatch):
    without_shared_prefect_server(monkeypatch)  # `make campaign` as a user runs it: the launch's own server
    work = tmp_path / "project"
    work.mkdir()
    for package in ("training", "tasks", "flows", "cluster"):
        shutil.copytree(REPO / package, work / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "dvc.yaml", work / "dvc.yaml")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["training"].update(steps=20, checkpoint_every=10, eval_every=10, warmup_steps=0)
    params["grid"] = {"training.lr": [0.05, 0.1]}
    params["resources"]["devices"] = 1
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    sh(work, "git", "init", "-q")
    sh(work, "dvc", "init", "-q")
    sh(work, "dvc", "config", "core.analytics", "false")
    first = sh(work, "dvc", "repro")
    assert "Running stage 'prepare'" in first and "Running stage 'campaign'" in first

    second = sh(work, "dvc", "repro")
    assert "Running stage" not in second, second
    assert "didn't change" in second or "up to date" in second, second

    shown = json.loads(sh(work, "dvc", "metrics", "show", "--json"))
    summary = shown[""]["data"]["metrics/campaign.json"]["data"]
    assert summary["finished"] == 2 and summary["failed"] == 0
    assert 0.0 < summary["best"]["val_accuracy"] <= 1.0

    remote = tmp_path / "remote"
    sh(work, "dvc", "remote", "add", "-d", "local", str(remote))
    sh(work, "dvc", "push")
    pushed = [p for p in remote.rglob("*") if p.is_file()]
    assert pushed, "dvc push wrote nothing to the remote"
    lock = yaml.safe_load((work / "dvc.lock").read_text())
    assert "checkpoints" in {o["path"] for o in lock["stages"]["campaign"]["outs"]}  # versioned by DVC


def test_what_dvc_writes_is_not_git_ignored():
    """DVC refuses to write a git-ignored dvc.lock (and its metrics): `make campaign` would fail."""
    for path in ("dvc.lock", "metrics/campaign.json", "data/digits.npz"):
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO)
        expected = path == "data/digits.npz"  # DVC's own data/.gitignore, once `dvc repro` wrote it; not ours
        assert ignored.returncode != 0 or expected, f"{path} is git-ignored: dvc repro would refuse it"
