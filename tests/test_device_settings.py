"""Settings the machine cannot honour fail before anything runs, naming the field
(tasks/device_settings.py), through `campaign launch` on this CPU host and on the check
itself for GPU machines."""

from __future__ import annotations

import pytest
import yaml

from conftest import campaign_cli
from tasks.device_settings import check_device_settings, compile_problem
from tasks.grid import expand_grid
from training.spec import SpecError, parse_spec


def spec_with(**sections):
    raw = {"campaign": {"name": "d"}, "model": {"name": "mlp"}, "training": {"steps": 4, "batch_size": 8, "lr": 0.1}}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return parse_spec(raw)


def test_a_memory_share_on_cpu_slots_exits_2_naming_the_field_and_writes_nothing(tmp_path, digits_npz):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "campaign": {"name": "d"}, "data": {"path": str(digits_npz)}, "model": {"name": "mlp", "width": 8},
        "training": {"steps": 4, "batch_size": 8, "lr": 0.1}, "resources": {"devices": 1, "memory_gb": 4},
        "cluster": {"cpu_slots": 2}, "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/m.db", "runs_dir": "runs"},
    }))
    done = campaign_cli("launch", "params.yaml", "--no-live", cwd=tmp_path)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and "resources.memory_gb: 4 GiB per device" in said and "`auto`" in said, said
    assert not (tmp_path / "runs").exists() and not (tmp_path / "m.db").exists()


def test_memory_auto_serves_both_kinds_of_machine():
    spec = spec_with(resources={"memory_gb": "auto"})
    check_device_settings(spec, expand_grid(spec), "cpu")
    check_device_settings(spec, expand_grid(spec), "gpu")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_precision_the_devices_lack_names_the_field(precision):
    spec = spec_with(training={"precision": precision})
    trials = expand_grid(spec)
    with pytest.raises(SpecError, match=rf"training.precision: {precision} autocast is not available on this machine's GPUs"):
        check_device_settings(spec, trials, "gpu", autocast_ok=lambda device, p: False)
    check_device_settings(spec, trials, "cpu")  # this host's CPU does both (torch's CPU autocast)


def test_bf16_on_a_gpu_without_cuda_here_is_refused_by_the_real_probe():
    """This host has no CUDA: a GPU inventory (a declared cluster, say) asking bf16 cannot be checked true."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe answers for it")
    spec = spec_with(training={"precision": "bf16"})
    with pytest.raises(SpecError, match="compute capability 8.0"):
        check_device_settings(spec, expand_grid(spec), "gpu")


def test_compile_without_a_compiler_names_the_field(monkeypatch):
    spec = spec_with(training={"compile": True})
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(SpecError, match=r"training.compile: torch.compile on CPU slots needs a C\+\+ compiler"):
        check_device_settings(spec, expand_grid(spec), "cpu")
    assert compile_problem("cpu", which=lambda name: "/usr/bin/" + name) is None
