"""The GPU suite's dry run (bench/gpu_suite.py --dry-run): every step of the GPU proof runs
on the CPU, tiny, so that the command a lent GPU machine runs in one call cannot rot.

One test per group of steps (`--steps`), so that the test run's workers share them: the whole
suite in one test held one worker for ~2.5 min. `profile` reads the campaign `packing` ran."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def check_zygotes_and_throughput(steps: dict) -> None:
    ways = steps["zygotes"]["figures"]
    # three zygotes, and a new interpreter (a zygote that refused has no "forked_by_zygote": its reason instead)
    assert sum(bool(way.get("forked_by_zygote")) for way in ways.values()) == 3 and len(ways) == 4, ways
    assert steps["throughput"]["figures"]["small_cnn (fp32)"]["ratio"] > 0


def check_gpt2(steps: dict) -> None:
    figures = steps["gpt2"]["figures"]
    assert set(figures["loops"]) == {"plain", "ours"}  # reduce-overhead: compiled loops only, on a GPU
    assert all(0 < loop["mfu"] < 1 for loop in figures["loops"].values()) and figures["ours / plain"] > 0
    assert {"nanoGPT", "llm.c"} <= set(figures["published"])


def check_packing_and_profile(steps: dict) -> None:
    assert steps["packing"]["figures"]["ResNet-20 grid"]["spec"].startswith("valid, 2 trials")  # its spec, checked
    figures, trials = steps["packing"]["figures"]["default campaign"], 4  # the ResNet grid runs on a GPU only
    packed = figures["packed (memory_gb: auto)"]
    assert packed["trials"] == trials and len(packed["timeline_s"]) == trials
    assert all(0 <= start < end for start, end in packed["timeline_s"].values())
    assert any(name.startswith("system/") for name in packed["system_metrics"])
    assert any(key.startswith("system/") for key in packed["mean_utilisation_percent"])
    estimates = figures["memory estimate / peak allocated"]
    assert len(estimates) == trials and all(e["estimate_gb"] > 0 and e["peak_allocated_gb"] is None for e in estimates.values())  # CPU slots
    assert steps["profile"]["figures"]["peak lines"]
    # Reports are kept in the repository (docs/gpu-proof/): they name no folder of the machine.
    assert "<work>/default_campaign/packed" in " ".join(steps["profile"]["figures"]["peak lines"])


def check_exact(steps: dict) -> None:
    assert steps["exact"]["figures"]["bit_for_bit"] is True


def check_precision(steps: dict) -> None:
    assert "bf16 speed-up" in steps["precision"]["figures"]
    accuracy = steps["precision"]["figures"]["final val_accuracy (per seed)"]
    assert {k: len(v) for k, v in accuracy.items()} == {"fp32": 2, "bf16": 2}


GROUPS = {"zygotes,throughput": check_zygotes_and_throughput, "gpt2": check_gpt2, "packing,profile": check_packing_and_profile, "exact": check_exact,
          "precision": check_precision}


def test_the_groups_cover_every_step_of_the_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", REPO / "bench" / "gpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    covered = [name for group in GROUPS for name in group.split(",")]
    assert sorted(covered) == sorted(suite.STEPS) and len(covered) == len(set(covered))


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_every_step_of_the_gpu_suite_runs_on_the_cpu_and_reports(tmp_path, group):
    done = subprocess.run([sys.executable, "bench/gpu_suite.py", "--dry-run", "--steps", group, "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "report.json").read_text())
    failed = {name: step["log"][-1][-1500:] for name, step in report["steps"].items() if not step["ok"]}
    assert done.returncode == 0 and not failed, failed or done.stdout[-2000:] + done.stderr[-2000:]
    steps = report["steps"]
    assert list(steps) == group.split(",") and report["dry_run"]
    GROUPS[group](steps)
    markdown = (tmp_path / "report.md").read_text()
    # Every group holds a step with a goal, which a dry run must not judge.
    assert "dry run on the CPU" in markdown and "goal not judged (dry run)" in markdown
    for text in (markdown, (tmp_path / "report.json").read_text()):
        assert "gpu-suite-" not in text and str(REPO) not in text
