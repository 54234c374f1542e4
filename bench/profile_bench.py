"""Bench of the per-layer profiler and the step-time prior. Prints figures; passes nothing.

    PYTHONPATH=. .venv/bin/python bench/profile_bench.py            # both parts, ~2 min here
    PYTHONPATH=. .venv/bin/python bench/profile_bench.py --part prior --steps 60 --rounds 3

Part "overhead": what profiling a trial costs (probe + profile of the default SmallCNN at
batch 64), in seconds and as a share of that trial's run (a plain 300-step training loop
of the same model on digits-shaped data, timed here).

Part "prior": predicted versus measured DDP step time at 1 and 2 processes (real
torchrun, gloo on CPU, one core and one thread per process) for models of different
shapes. Each model is profiled in this process (one thread). The first model's DDP runs
calibrate what the prior cannot see in a profile: the link (the bare all-reduce probe at
2 processes) and DDP's per-bucket cost (the all-reduce time at 1 process); the other
models' predictions use those and their own profile only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cluster.step_time_prior import ProfileStepTimeModel  # noqa: E402
from training.models import build_model  # noqa: E402
from training.profiler import DdpProfile, profile_model  # noqa: E402
from training.roofline import cpu_threads, probe_device  # noqa: E402

MODELS = {  # name: (registered model, kwargs)
    "small_cnn": ("small_cnn", {"width": 16}),
    "wide_cnn": ("small_cnn", {"width": 64}),
    "mlp": ("mlp", {"width": 512, "depth": 3}),
}


def digits_batch(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)


def plain_training_s(steps: int, batch: int) -> float:
    """A trial's run without profiling: `steps` SGD steps of the default SmallCNN."""
    torch.manual_seed(0)
    model = build_model("small_cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = digits_batch(batch * 8)
    t0 = time.perf_counter()
    for s in range(steps):
        i = (s % 8) * batch
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[i:i + batch]), y[i:i + batch]).backward()
        opt.step()
    return time.perf_counter() - t0


def overhead(args: argparse.Namespace) -> None:
    with cpu_threads(1):
        train_s = plain_training_s(args.train_steps, args.batch)
    t0 = time.perf_counter()
    peaks = probe_device(torch.device("cpu"))
    probe_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    profile_model(build_model("small_cnn"), digits_batch(args.batch), F.cross_entropy, torch.device("cpu"))
    profile_s = time.perf_counter() - t0
    total = probe_s + profile_s
    print(f"\n== overhead of profiling a trial (SmallCNN width 16, batch {args.batch}, 1 CPU thread)")
    print(f"plain training, {args.train_steps} steps: {train_s:.2f} s")
    print(f"roofline probe: {probe_s:.2f} s ({peaks.peak_flops / 1e9:.1f} GFLOP/s, {peaks.peak_bytes_per_s / 1e9:.1f} GB/s)")
    print(f"per-layer profile: {profile_s:.2f} s")
    print(f"total: {total:.2f} s = {total / train_s:.0%} of the trial's training time")


def run_ddp(name: str, nproc: int, batch: int, steps: int, port: int) -> DdpProfile:
    model, kwargs = MODELS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        # Not pinned to cores (no CAMPAIGN_CPU_CORES): on a host shared with other work a pinned
        # rank cannot dodge a busy core, and the profile it is compared with runs unpinned too.
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        env.pop("CAMPAIGN_CPU_CORES", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "training.profile_ddp", "--model", model, "--model-kwargs", json.dumps(kwargs),
               "--batch-size", str(batch), "--steps", str(steps), "--out", str(out)]
        subprocess.run(cmd, env=env, cwd=REPO, check=True, capture_output=True)
        return DdpProfile.from_json(out.read_text())


def spread(values: list[float]) -> str:
    return f"{max(values) / min(values) - 1:.0%}" if len(values) > 1 else "-"


def prior(args: argparse.Namespace) -> None:
    print(f"\n== step-time prior vs measured DDP step (global batch {args.batch}, gloo on CPU, 1 thread per process, "
          f"{args.rounds} round(s), medians; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    port = 29500 + os.getpid() % 1000
    calibration: list[DdpProfile] = []  # the first model's runs: the link (2 processes), DDP's per-bucket cost (1)
    rows = []
    for name in args.models:
        model, kwargs = MODELS[name]
        predicted: dict[int, list[float]] = {1: [], 2: []}
        measured: dict[int, list[DdpProfile]] = {1: [], 2: []}
        for _ in range(args.rounds):  # profile and measure in the same round: the host's load drifts
            profile = profile_model(build_model(model, **kwargs), digits_batch(args.batch), F.cross_entropy, torch.device("cpu"))
            runs = {n: run_ddp(name, n, args.batch, args.steps, port) for n in (1, 2)}
            calibration = calibration or list(runs.values())
            prior_model = ProfileStepTimeModel.from_profile(profile, calibration)
            for n, run in runs.items():
                measured[n].append(run)
                predicted[n].append(prior_model.step_time(n))
        for n in (1, 2):
            rows.append((name, n, predicted[n], measured[n], prior_model.breakdown(n), name == args.models[0]))
    print(f"{'model':10} {'n':>2} {'predicted':>9} {'measured':>8} {'error':>7} {'spread':>6}   "
          "predicted compute / all-reduce / DDP overhead;  measured all-reduce (waiting for the other rank)")
    errors = []
    for name, n, predicted, runs, b, calibrated in rows:
        got, want = statistics.median(predicted), statistics.median(r.step_s for r in runs)
        if not calibrated:
            errors.append(abs(got - want) / want)
        compute = b.forward_s + b.backward_s + b.optimizer_s
        wait = statistics.median(r.peer_wait_s or 0.0 for r in runs)
        print(f"{name:10} {n:>2} {got * 1e3:9.2f} {want * 1e3:8.2f} {(got - want) / want:+7.1%} {spread([r.step_s for r in runs]):>6}   "
              f"{compute * 1e3:.2f} / {b.exposed_allreduce_s * 1e3:.2f} / {b.overhead_s * 1e3:.2f};  "
              f"{statistics.median(r.allreduce_s for r in runs) * 1e3:.2f} ({wait * 1e3:.2f})" + ("   [calibration model]" if calibrated else ""))
    print("times in ms; spread: slowest over fastest measured round, minus one")
    if errors:
        print(f"models not used for calibration: mean |error| {statistics.fmean(errors):.1%}, max |error| {max(errors):.1%}")
    link = next((r.link for r in calibration if r.link is not None), None)
    if link is not None:
        print(f"link probe ({args.models[0]}, 2 processes): {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, all-reduce latency "
              f"{link.latency_s * 1e6:.0f} us; median ms by size: " + ", ".join(f"{b // 1024} KiB {t * 1e3:.2f}" for b, t in link.points))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("overhead", "prior", "all"), default="all")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=40, help="measured DDP steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="DDP runs per model and size (median)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    if args.part in ("overhead", "all"):
        overhead(args)
    if args.part in ("prior", "all"):
        prior(args)


if __name__ == "__main__":
    main()
