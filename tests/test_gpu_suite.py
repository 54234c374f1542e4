"""The GPU suite's dry run (bench/gpu_suite.py --dry-run): every step of the GPU proof runs
on the CPU, tiny, so that the command the next GPU session runs in one call cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_every_step_of_the_gpu_suite_runs_on_the_cpu_and_reports(tmp_path):
    done = subprocess.run([sys.executable, "bench/gpu_suite.py", "--dry-run", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "report.json").read_text())
    failed = {name: step["log"][-1][-1500:] for name, step in report["steps"].items() if not step["ok"]}
    assert done.returncode == 0 and not failed, failed or done.stdout[-2000:] + done.stderr[-2000:]
    steps = report["steps"]
    assert set(steps) == {"throughput", "packing", "exact", "profile", "precision"} and report["dry_run"]
    assert steps["throughput"]["figures"]["small_cnn (fp32)"]["ratio"] > 0
    for campaign, trials in (("default campaign", 4), ("ResNet-20 grid", 2)):
        packed = steps["packing"]["figures"][campaign]["packed (memory_gb: auto)"]
        assert packed["trials"] == trials and len(packed["timeline_s"]) == trials
        assert all(0 <= start < end for start, end in packed["timeline_s"].values())
        assert any(name.startswith("system/") for name in packed["system_metrics"])
        assert any(key.startswith("system/") for key in packed["mean_utilisation_percent"])
        estimates = steps["packing"]["figures"][campaign]["memory estimate / peak allocated"]
        assert len(estimates) == trials and all(e["estimate_gb"] > 0 and e["peak_allocated_gb"] is None for e in estimates.values())  # CPU slots
    assert steps["exact"]["figures"]["bit_for_bit"] is True
    assert steps["profile"]["figures"]["peak lines"] and "bf16 speed-up" in steps["precision"]["figures"]
    accuracy = steps["precision"]["figures"]["final val_accuracy (per seed)"]
    assert {k: len(v) for k, v in accuracy.items()} == {"fp32": 2, "bf16": 2}
    markdown = (tmp_path / "report.md").read_text()
    assert "dry run on the CPU" in markdown and "goal not judged (dry run)" in markdown
    # Reports are kept in the repository (docs/gpu-proof/): they name no folder of the machine.
    assert "<work>/default_campaign/packed" in " ".join(steps["profile"]["figures"]["peak lines"])
    for text in (markdown, (tmp_path / "report.json").read_text()):
        assert "gpu-suite-" not in text and str(REPO) not in text
