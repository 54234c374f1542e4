"""No host-device synchronisation inside a training step (issue 29).

On a GPU a step that reads a tensor's value on the host (`.item()`, `bool(tensor)`,
`nonzero`, a copy to the CPU) waits for the device and stalls the launch queue; what
`torch.cuda.set_sync_debug_mode` reports there, a TorchDispatchMode sees here on the CPU:
every op that makes a value visible to Python. The trainer runs 20 steps of each workload
(the built-in SmallCNN, the ResNet-20 and char-GPT examples) in this process, and no step
but the first (the data pipeline starts), the logging, evaluation and checkpoint ones may
hold such an op.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tasks.grid import expand_grid
from tasks.workload import trial_workload
from training.config import TrialConfig
from training.spec import load_spec
from training.trainer import DistEnv, Trainer

REPO = Path(__file__).resolve().parent.parent
aten = torch.ops.aten
READS_ON_HOST = {aten._local_scalar_dense, aten.nonzero, aten.is_nonzero, aten.equal, aten.allclose}
STEPS = 20


class HostReads(TorchDispatchMode):
    """Records each op that hands a tensor's value to the host, with the step it ran in.

    Not counted: reads of the optimizer's step counters, which torch.optim keeps on the host
    (a CPU tensor, unless `capturable`) whatever the device: on a GPU they do not wait for it."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.optimizer = optimizer
        self.step: int | None = None
        self.seen: list[tuple[int | None, str]] = []  # (step, "op at file:line" of the nearest caller outside torch)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in READS_ON_HOST or (func.overloadpacket is aten._to_copy and _to_host(args, kwargs)):
            if not self._host_counter(args[0] if args else None):
                self.seen.append((self.step, f"{func} at {_caller()}"))
        return func(*args, **kwargs)

    def _host_counter(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and any(
            state.get("step") is tensor for state in self.optimizer.state.values())


def _caller() -> str:
    """The innermost frame outside torch itself: the code that asked for the value."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if f"{os.sep}torch{os.sep}" not in frame.filename and not frame.filename.endswith("test_host_sync.py"):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "?"


def _to_host(args, kwargs) -> bool:
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    target = kwargs.get("device")
    return source is not None and source.device.type != "cpu" and target is not None and torch.device(target).type == "cpu"


def config(spec_path: Path, trial_dir: Path, digits: Path, **overrides) -> TrialConfig:
    spec = load_spec(spec_path)
    trial = expand_grid(spec)[0]
    work = trial_workload(trial.spec)
    if work["data"].get("path"):
        work["data"]["path"] = str(digits)
    t = trial.spec.training
    return TrialConfig(trial_id=trial_dir.name, seed=0, **work, steps=STEPS, batch_size=min(t.batch_size, 32), lr=t.lr,
                       precision="fp32", grad_clip_norm=t.grad_clip_norm, log_every=STEPS, eval_every=STEPS,
                       checkpoint_every=STEPS, trial_dir=str(trial_dir), **overrides)


def host_reads(example: str, trial_dir: str, digits: str) -> dict:
    """Train 20 steps of `example` in this process under HostReads: the result's step count
    and every read, with its step. Run in a process of its own (the test below), as a trial
    runs: a DataLoader forks its workers from it, and a fork of a long pytest process
    inherits whatever earlier tests left behind (one such worker exited 1 in CI)."""
    os.chdir(REPO)  # the examples' packages import from the repository
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = config(REPO / example, Path(trial_dir), Path(digits))
        trainer = Trainer(cfg, torch.device("cpu"))
        trainer.attach(DistEnv(0, 1, 0))
        reads = HostReads(trainer.optimizer)
        plain_step = trainer.train_step

        def watched_step(step, batches):
            reads.step = step + 1  # the step as the loop counts it after this one
            try:
                return plain_step(step, batches)
            finally:
                reads.step = None

        trainer.train_step = watched_step
        try:
            with reads:
                result = trainer.train()
        finally:
            trainer.close()
    finally:
        dist.destroy_process_group()
    return {"steps": result["steps"] if result else None, "seen": reads.seen}


@pytest.mark.slow
@pytest.mark.parametrize("example", ["params.yaml", "examples/resnet.yaml", "examples/chargpt.yaml"])
def test_no_step_reads_a_value_on_the_host(example, tmp_path, digits_npz):
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_host_sync import host_reads; "
            f"print('READS ' + json.dumps(host_reads({example!r}, {str(tmp_path / 'trial')!r}, {str(digits_npz)!r})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("READS "))[len("READS "):])
    result = {"steps": found["steps"]}
    reads_seen = [tuple(r) for r in found["seen"]]
    assert result["steps"] == STEPS
    in_steps = [(step, op) for step, op in reads_seen if step is not None]
    # The first step opens the data pipeline (a DataLoader draws its base seed, a host tensor);
    # the step before a log step measures the gradient noise scale for that log (a read, by
    # design); the last is the log, evaluation and checkpoint step. Any per-step read shows in the rest.
    allowed = {1, STEPS - 1, STEPS}
    assert [(s, op) for s, op in in_steps if s not in allowed] == [], in_steps[:10]
    assert any(step is None for step, _ in reads_seen)  # the mode does see reads: the log step's own


def test_a_gpu_feed_pins_its_batches_for_asynchronous_copies_and_a_cpu_feed_does_not():
    from training.batches import loader_options

    on_gpu = loader_options(torch.device("cuda", 0), 2)
    assert {k: on_gpu[k] for k in ("num_workers", "pin_memory", "prefetch_factor")} == {"num_workers": 2, "pin_memory": True, "prefetch_factor": 4}
    # workers never fork the trainer, which runs threads: they come from a fork server
    assert on_gpu["multiprocessing_context"].get_start_method() == "forkserver"
    assert loader_options(torch.device("cuda", 0), 0)["pin_memory"] is True  # pinned even without workers
    on_cpu = loader_options(torch.device("cpu"), 2)
    assert (on_cpu["pin_memory"], on_cpu["multiprocessing_context"].get_start_method()) == (False, "forkserver")
    assert loader_options(torch.device("cpu"), 0)["prefetch_factor"] is None  # DataLoader refuses one without workers
