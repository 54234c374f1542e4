"""Bench of the per-layer profiler and the step-time prior. Prints figures; passes nothing.

    .venv/bin/python bench/profile_bench.py            # both parts, ~2 min here
    .venv/bin/python bench/profile_bench.py --part prior --steps 60 --rounds 3

Part "overhead": what profiling a trial costs (probe + profile of the default SmallCNN at
batch 64), in seconds and as a share of that trial's run (a plain 300-step training loop
of the same model on digits-shaped data, timed here).

Part "prior": predicted versus measured DDP step time at 1 and 2 processes (real
torchrun, gloo on CPU, one thread per process, not pinned, on the digits samples) for
models of different shapes. Each round profiles each model in this process (one thread)
and then measures it with training.profile_ddp, so both see the host's load of that
moment. The first model's DDP runs calibrate what a profile cannot see: the link (the bare
all-reduce probe and the all-reduces inside steps, at 2 processes), the wait for the slower
rank, DDP's per-bucket cost (the all-reduce time at 1 process) and how much ranks computing
together slow each other; the other models' predictions use those, the roofline probe's
memory bandwidth and their own profile, nothing of their own DDP runs.
"Spread" is the measurement's own round-to-round variation: an error below it cannot be
told from noise.
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
from training.data import prepare_digits  # noqa: E402
from training.profiler import DdpProfile, ModelProfile, profile_model  # noqa: E402
from training.roofline import cpu_threads, probe_device  # noqa: E402
from training.workload import build_model, datasets, sample_batch  # noqa: E402

MODELS = {  # name: the model as a trial config has it (training.workload.build_model)
    "small_cnn": {"name": "small_cnn", "width": 16},
    "wide_cnn": {"name": "small_cnn", "width": 64},
    "mlp": {"name": "mlp", "width": 512, "depth": 3},
}
DEFAULT_MODEL = {"name": "small_cnn"}  # the built-in SmallCNN with its defaults (width 16)


def digits_batch(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)


def plain_training_s(steps: int, batch: int) -> float:
    """A trial's run without profiling: `steps` SGD steps of the default SmallCNN."""
    torch.manual_seed(0)
    model = build_model(DEFAULT_MODEL)
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
    profile_s = []
    for _ in range(2):  # the first call in a process also pays one-time set-up (kernels, flop counter)
        t0 = time.perf_counter()
        profile_model(build_model(DEFAULT_MODEL), digits_batch(args.batch), F.cross_entropy, torch.device("cpu"))
        profile_s.append(time.perf_counter() - t0)
    print(f"\n== overhead of profiling a trial (SmallCNN width 16, batch {args.batch}, 1 CPU thread)")
    print(f"plain training, {args.train_steps} steps: {train_s:.2f} s")
    print(f"roofline probe: {probe_s:.2f} s ({peaks.peak_flops / 1e9:.1f} GFLOP/s, {peaks.peak_bytes_per_s / 1e9:.1f} GB/s)")
    print(f"per-layer profile: {profile_s[0]:.2f} s (a second call: {profile_s[1]:.2f} s)")
    total = probe_s + profile_s[0]
    print(f"probe + profile: {total:.2f} s = {total / train_s:.0%} of the trial's training time")


def run_ddp(name: str, data: Path, nproc: int, batch: int, steps: int, port: int) -> DdpProfile:
    workload = {"model": MODELS[name], "data": {"path": str(data)}, "loss": {"name": "cross_entropy"}}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ddp.json"
        # Not pinned to cores (no CAMPAIGN_CPU_CORES): on a host shared with other work a pinned
        # rank cannot dodge a busy core, and the profile it is compared with runs unpinned too.
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        env.pop("CAMPAIGN_CPU_CORES", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "training.profile_ddp", "--workload", json.dumps(workload),
               "--batch-size", str(batch), "--steps", str(steps), "--out", str(out)]
        subprocess.run(cmd, env=env, cwd=REPO, check=True, capture_output=True)
        return DdpProfile.from_json(out.read_text())


def spread(values: list[float]) -> str:
    return f"{max(values) / min(values) - 1:.0%}" if len(values) > 1 else "-"


def prior(args: argparse.Namespace) -> None:
    print(f"\n== step-time prior vs measured DDP step (global batch {args.batch}, gloo on CPU, 1 thread per process, "
          f"{args.rounds} round(s), medians; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    port = 29500 + os.getpid() % 1000
    peaks = probe_device(torch.device("cpu"))
    measured: dict[str, list[tuple[ModelProfile, dict[int, DdpProfile]]]] = {name: [] for name in args.models}
    with tempfile.TemporaryDirectory(prefix="profile-bench-") as tmp:
        data = prepare_digits(Path(tmp) / "digits.npz")  # training.profile_ddp trains on real samples: both use these
        batch = sample_batch(datasets({"path": str(data)})[0], args.batch)
        for _ in range(args.rounds):  # each model profiled and measured in the same round: the host's load drifts
            for name in args.models:
                profile = profile_model(build_model(MODELS[name]), batch, F.cross_entropy, torch.device("cpu"))
                measured[name].append((profile, {n: run_ddp(name, data, n, args.batch, args.steps, port) for n in (1, 2)}))
    # The first model's runs, all rounds: the link and wait (2 processes), DDP's per-bucket cost (1).
    calibration = [run for _, runs in measured[args.models[0]] for run in runs.values()]
    rows = []
    for name, rounds in measured.items():
        for n in (1, 2):
            priors = [ProfileStepTimeModel.from_profile(p, calibration, memory_bytes_per_s=peaks.peak_bytes_per_s) for p, _ in rounds]
            predicted = [prior.step_time(n) for prior in priors]
            rows.append((name, n, predicted, [runs[n] for _, runs in rounds], priors[-1].breakdown(n), name == args.models[0]))
    print(f"{'model':10} {'n':>2} {'predicted':>9} {'measured':>8} {'error':>7} {'spread':>6}   "
          "predicted compute / all-reduce / wait / DDP overhead;  measured all-reduce (of it waiting)")
    errors = []
    for name, n, predicted, runs, b, calibrated in rows:
        got, want = statistics.median(predicted), statistics.median(r.step_s for r in runs)
        if not calibrated:
            errors.append(abs(got - want) / want)
        compute = b.forward_s + b.backward_s + b.optimizer_s
        wait = statistics.median(r.peer_wait_s or 0.0 for r in runs)
        print(f"{name:10} {n:>2} {got * 1e3:9.2f} {want * 1e3:8.2f} {(got - want) / want:+7.1%} {spread([r.step_s for r in runs]):>6}   "
              f"{compute * 1e3:.2f} / {b.exposed_allreduce_s * 1e3:.2f} / {b.straggler_s * 1e3:.2f} / {b.overhead_s * 1e3:.2f};  "
              f"{statistics.median(r.allreduce_s for r in runs) * 1e3:.2f} ({wait * 1e3:.2f})" + ("   [calibration model]" if calibrated else ""))
    print("times in ms; spread: slowest over fastest measured round, minus one")
    if errors:
        print(f"models not used for calibration: mean |error| {statistics.fmean(errors):.1%}, max |error| {max(errors):.1%}")
    cal = ProfileStepTimeModel.from_profile(measured[args.models[0]][-1][0], calibration, memory_bytes_per_s=peaks.peak_bytes_per_s)
    print(f"calibrated on {args.models[0]}: link {cal.intra_node.bandwidth_bytes_per_s / 1e9:.2f} GB/s and "
          f"{cal.intra_node.hop_latency_s * 1e6:.0f} us a hop, waiting for the slower rank {cal.straggler_fraction:.0%} of compute, "
          f"co-run slowdown {cal.corun_slowdown_per_rank:.0%} per extra rank, DDP {cal.bucket_overhead_s * 1e6:.0f} us a bucket, "
          f"memory {cal.memory_bytes_per_s / 1e9:.1f} GB/s")
    for run in calibration:
        if run.link is not None:
            print("  all-reduce probe, median ms by size: " + ", ".join(f"{b // 1024} KiB {t * 1e3:.2f}" for b, t in run.link.points))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("overhead", "prior", "all"), default="all")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=40, help="measured DDP steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="DDP runs per model and size (median)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    if args.part in ("overhead", "all"):
        overhead(args)
    if args.part in ("prior", "all"):
        prior(args)


if __name__ == "__main__":
    main()
