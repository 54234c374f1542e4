"""The Ray Tune bench (bench/vs_ray_tune.py) without Ray or a campaign: its dry run checks every
case's spec as `campaign launch` reads it, and its figures come out of the timestamps the
function writes as the bench reads them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def bench():
    if "vs_ray_tune" not in sys.modules:  # its dataclasses look their module up there
        spec = importlib.util.spec_from_file_location("vs_ray_tune", REPO / "bench" / "vs_ray_tune.py")
        sys.modules["vs_ray_tune"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["vs_ray_tune"]


def write_marks(folder: Path, trials: dict[str, list[tuple[str, float, int]]]) -> Path:
    folder.mkdir()
    for trial, events in trials.items():
        lines = [json.dumps({"event": e, "t": t, "step": s, "pid": 1, "val_loss": 1.0 / (1 + s)}) for e, t, s in events]
        (folder / f"{trial}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_the_dry_run_checks_every_case_as_a_launch_would():
    done = subprocess.run([sys.executable, "bench/vs_ray_tune.py", "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    vs = bench()
    for name, case in vs.CASES.items():
        assert f"{name}: campaign spec checked, {case.trials} trials" in done.stdout


def test_both_sides_try_the_same_points():
    vs = bench()
    case = vs.CASES["asha"]
    spec = vs.campaign_spec(case, "a", Path("/tmp"), Path("d.npz"), Path("m"))
    assert spec["grid"] == {"training.kwargs.lr": list(case.lrs)} and len(set(case.lrs)) == 16
    assert spec["early_stopping"]["min_steps"] == vs.ASHA["min_steps"]
    assert vs.campaign_spec(vs.CASES["grid"], "g", Path("/tmp"), Path("d.npz"), Path("m"))["grid"]["training.kwargs.width"] == [256, 512]


def test_a_handover_pairs_each_end_with_the_start_that_took_its_slot(tmp_path):
    vs = bench()
    # Two slots: a and b start at once; c takes the first slot freed (a's, at 2.0), d the next (b's, at 3.0).
    marks = write_marks(tmp_path / "m", {
        "a": [("first", 0.0, 0), ("report", 2.0, 2)], "b": [("first", 0.1, 0), ("report", 3.0, 2)],
        "c": [("first", 2.25, 0), ("report", 4.0, 2)], "d": [("first", 3.5, 0), ("report", 5.0, 2)],
    })
    assert vs.handover_gaps(vs.read_marks(marks)) == [0.25, 0.5]
    assert vs.process_gaps(vs.read_marks(marks)) == [0.25, 0.5]  # marked by one process: each end to the start after it
    assert vs.best_final(vs.read_marks(marks), 2) == (1 / 3, 4)


def test_a_handover_in_one_process_pairs_a_trial_s_end_with_the_next_start_there(tmp_path):
    vs = bench()
    folder = tmp_path / "m"
    folder.mkdir()
    events = {"a": [("first", 0.0, 1), ("report", 1.0, 1), ("report", 2.0, 1)], "b": [("first", 0.1, 2), ("report", 3.0, 2)],
              "c": [("first", 3.75, 2), ("report", 4.0, 2)], "d": [("first", 5.0, 1), ("report", 6.0, 1)]}
    for trial, evs in events.items():  # a and d in process 1, b and c in process 2
        (folder / f"{trial}.jsonl").write_text("".join(json.dumps({"event": e, "t": t, "step": 1, "pid": p}) + "\n" for e, t, p in evs))
    assert sorted(vs.process_gaps(vs.read_marks(folder))) == [0.75, 3.0]  # a's last report (not its first) to d; b to c
    assert vs.handover_gaps(vs.read_marks(folder)) == [1.75, 2.0]  # first freed, first taken: a's end with c's start, b's with d's


def test_steps_lost_to_a_kill_are_those_reported_before_it_and_trained_again(tmp_path):
    vs = bench()
    marks = write_marks(tmp_path / "m", {
        "done": [("first", 0.0, 0), ("report", 1.0, 300)],  # finished before the kill, not run again
        "resumed": [("first", 0.0, 0), ("report", 1.5, 75), ("first", 10.0, 50), ("report", 11.0, 300)],
        "rerun": [("first", 0.0, 0), ("report", 1.0, 300), ("first", 10.0, 0), ("report", 11.0, 300)],
    })
    assert vs.lost_steps(vs.read_marks(marks), killed_at=2.0, resumed_at=9.0) == 25 + 300
