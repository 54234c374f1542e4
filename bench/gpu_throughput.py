"""Our trainer against a plain PyTorch loop: steps per second on the same model, data and precision.

    .venv/bin/python bench/gpu_throughput.py [--workloads small_cnn,resnet,gpt] [--rounds 5] [--steps N]
    .venv/bin/python bench/gpu_throughput.py --host-overhead    # tiny shapes: the host's work per step

`--host-overhead` shrinks every workload until the device's share of a step is negligible
(batch 4, a few channels): what is left is the host's work per step (Python, dispatch,
the data path), which on a GPU is what a small model's step waits on. It prints the extra
host time per step of ours over plain, the median over alternating rounds (goal <= 5 %).

On whatever device is present (the first GPU, else the CPU), for three workloads: the
built-in SmallCNN on digits, the ResNet-20 example on CIFAR-shaped data, and the
character GPT example on the standard library's sources (a map-style dataset: both loops
read it through a DataLoader). Per workload, rounds of the two loops alternate in one
process (the order rotating; on the CPU one thread, as a trial on a CPU slot), each timed over `--steps` steps after a warm-up; the
figure is the median over rounds of ours / plain in steps per second (>= 0.97 is the goal).

"Plain" is what a person writes by hand: the model on the device, the dataset's tensors
on the device and a random permutation per epoch (a DataLoader with shuffle for the
map-style dataset), autocast, the optimizer and the same warm-up + cosine schedule, the
loss read every `--log-every` steps. "Ours" is training.trainer.Trainer's loop at one
process (no DDP wrapper there: nothing to all-reduce), with the same logging interval,
progress files, and no checkpoint inside the timed window (bench/elastic_bench.py
measures checkpoint pauses); its extra work is the schedule-independent sample order and
per-logical-rank RNG seeding.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from training.config import TrialConfig  # noqa: E402
from training.data import prepare_digits  # noqa: E402
from training.trainer import DistEnv, Trainer, lr_factor  # noqa: E402
from training.workload import build_loss, build_model, build_optimizer, datasets, move, split_pair  # noqa: E402

CONTROL_EVERY = 10  # the trainer looks at its stop hook every 10 steps: rounds are multiples of it
PRECISION = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Workload:
    name: str
    model: dict
    data: dict
    batch: int
    optimizer: dict
    lr: float


def workloads(on_gpu: bool, digits: Path, tiny: bool = False) -> dict[str, Workload]:
    """Sizes that keep a GPU busy, or a CPU round under a minute; `tiny`: host-bound shapes."""
    sgd = {"name": "SGD", "kwargs": {"momentum": 0.9}}
    if tiny:
        gpt = {"block": 16, "layers": 1, "dim": 16, "heads": 2, "dropout": 0.1}
        return {
            "small_cnn": Workload("small_cnn", {"name": "small_cnn", "width": 4, "dropout": 0.1}, {"path": str(digits)}, 4, sgd, 0.05),
            "resnet": Workload("resnet", {"target": "examples.workloads.resnet:resnet", "kwargs": {"depth": 8, "width": 4}},
                               {"target": "examples.workloads.resnet:cifar_like", "kwargs": {"train": 500, "val": 50}}, 4, sgd, 0.1),
            "gpt": Workload("gpt", {"target": "examples.workloads.chargpt:gpt", "kwargs": gpt},
                            {"target": "examples.workloads.chargpt:stdlib_text", "kwargs": {"block": 16, "chars": 100_000}, "workers": 0},
                            4, {"name": "AdamW", "kwargs": {"weight_decay": 0.1}}, 1e-3),
        }
    resnet = {"depth": 20, "width": 16} if on_gpu else {"depth": 8, "width": 8}
    gpt = {"block": 128, "layers": 4, "dim": 256, "heads": 8, "dropout": 0.1} if on_gpu else \
          {"block": 64, "layers": 2, "dim": 64, "heads": 4, "dropout": 0.1}
    workers = 2 if on_gpu else 0
    return {
        "small_cnn": Workload("small_cnn", {"name": "small_cnn", "width": 32, "dropout": 0.1}, {"path": str(digits)},
                              128, sgd, 0.05),
        "resnet": Workload("resnet", {"target": "examples.workloads.resnet:resnet", "kwargs": resnet},
                           {"target": "examples.workloads.resnet:cifar_like", "kwargs": {"train": 5000, "val": 500}},
                           128 if on_gpu else 32, sgd, 0.1),
        "gpt": Workload("gpt", {"target": "examples.workloads.chargpt:gpt", "kwargs": gpt},
                        {"target": "examples.workloads.chargpt:stdlib_text",
                         "kwargs": {"block": gpt["block"], "chars": 1_000_000}, "workers": workers},
                        64 if on_gpu else 16, {"name": "AdamW", "kwargs": {"weight_decay": 0.1}}, 1e-3),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Plain:
    """The hand-written loop."""

    def __init__(self, w: Workload, device: torch.device, precision: str, total_steps: int, log_every: int):
        torch.manual_seed(0)
        self.device, self.log_every = device, log_every
        self.model = build_model(w.model).to(device)
        self.loss_fn = build_loss({"name": "cross_entropy"})
        self.opt = build_optimizer(w.optimizer, self.model.parameters(), w.lr)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor("cosine", 20, total_steps, s))
        self.dtype = PRECISION[precision]
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        train, _ = datasets(w.data)
        self.batch = w.batch
        if isinstance(train, TensorDataset):
            self.x, self.y = (t.to(device) for t in train.tensors)
            self.batches = self._device_batches()
        else:
            loader = DataLoader(train, batch_size=w.batch, shuffle=True, drop_last=True, num_workers=w.data.get("workers", 0),
                                pin_memory=device.type == "cuda", persistent_workers=bool(w.data.get("workers", 0)))
            self.batches = self._loader_batches(loader)
        self.step = 0

    def _device_batches(self):
        n = len(self.y)
        while True:
            perm = torch.randperm(n, device=self.device)
            for s in range(n // self.batch):
                idx = perm[s * self.batch:(s + 1) * self.batch]
                yield self.x[idx], self.y[idx]

    def _loader_batches(self, loader):
        while True:
            for batch in loader:
                x, y = split_pair(batch)
                yield move(x, self.device, True), move(y, self.device, True)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            x, y = next(self.batches)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                loss = self.loss_fn(self.model(x), y)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            if self.step % self.log_every == 0:
                loss.item()


class Ours:
    """training.trainer.Trainer's own loop, stopped at a step by its control hook."""

    def __init__(self, w: Workload, device: torch.device, precision: str, total_steps: int, log_every: int, work: Path, **settings):
        cfg = TrialConfig(trial_id=f"bench-{w.name}", seed=0, model=w.model, data=w.data, optimizer=w.optimizer,
                          steps=total_steps, batch_size=w.batch, lr=w.lr, warmup_steps=20, precision=precision,
                          checkpoint_every=10**9, eval_every=10**9, log_every=log_every, control_every=CONTROL_EVERY,
                          trial_dir=str(work / w.name), **settings)
        self.trainer = Trainer(cfg, device)
        self.trainer.attach(DistEnv(0, 1, 0))
        self.device = device

    def run(self, steps: int) -> None:
        target = self.trainer.step + steps
        self.trainer.train(should_stop=lambda step: step >= target)
        assert self.trainer.step == target, (self.trainer.step, target)

    def close(self) -> None:
        self.trainer.detach()
        self.trainer.close()


SYNC_SITES: Counter[str] = Counter()


def timed(loop, steps: int, device: torch.device, syncs: list[int] | None = None) -> float:
    """Steps per second over `steps` steps; on a GPU with `syncs`, the window runs under
    torch.cuda.set_sync_debug_mode("warn") and the host-device syncs it warned of are appended."""
    sync(device)
    watch = syncs is not None and device.type == "cuda"
    caught: list[tuple[str, str]] = []

    def keep(message, category, filename, lineno, file=None, line=None):
        # A sync warned of inside torch names torch's own line: name its caller too.
        caller = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(traceback.extract_stack()[:-1])
                       if "/torch/" not in f.filename and "warnings" not in f.filename), "?")
        site = f"{Path(filename).name}:{lineno}"
        caught.append((str(message), site if "/torch/" not in filename else f"{site} via {caller}"))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        if watch:
            torch.cuda.set_sync_debug_mode("warn")
        # Only what the loop warns of counts: switching the mode warns once by itself (seen on
        # an H200 as the one sync left, "__init__.py:1270 via" this function's mode switch).
        shown, warnings.showwarning = warnings.showwarning, keep
        start = time.perf_counter()
        try:
            loop.run(steps)
        finally:
            warnings.showwarning = shown
            if watch:
                torch.cuda.set_sync_debug_mode("default")
        sync(device)
        elapsed = time.perf_counter() - start
    if watch:
        found = [site for message, site in caught if "synchroniz" in message]
        syncs.append(len(found))
        # The Python line that made each sync: what to fix when the count is not 0.
        SYNC_SITES.update(found)
    return steps / elapsed


def init_group(device: torch.device) -> None:
    """A process group of one on an in-memory store, as a warm worker's (training/worker.py):
    no port to pick (a free port picked first and bound later was taken by another process
    in between once, under a loaded `make test`: EADDRINUSE)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # one process: the loopback is enough
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="small_cnn,resnet,gpt")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default: 300 on a GPU, 100 on the CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 50 on a GPU, 20 on the CPU)")
    parser.add_argument("--precision", default=None, help="fp32 | bf16 | fp16 (default: bf16 on a GPU, fp32 on the CPU)")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--host-overhead", action="store_true", help="tiny shapes: the extra host time per step of ours (goal <= 5 %%)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here (bench/gpu_suite.py reads them)")
    args = parser.parse_args()
    report: dict = {"workloads": {}}

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # as a trial on a CPU slot runs (training.train.pick_device): one core
    steps = args.steps or (300 if on_gpu else 100)
    warmup = args.warmup or (50 if on_gpu else 20)
    precision = args.precision or ("bf16" if on_gpu else "fp32")
    if steps % CONTROL_EVERY or warmup % CONTROL_EVERY:
        parser.error(f"--steps and --warmup must be multiples of {CONTROL_EVERY}")
    total = warmup + args.rounds * steps + 10
    os.chdir(Path(__file__).resolve().parent.parent)  # the examples' targets import from the repo root
    name = torch.cuda.get_device_name(device) if on_gpu else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {name}; precision {precision}; {args.rounds} rounds of {steps} steps after {warmup}; torch {torch.__version__}")
    init_group(device)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        digits = prepare_digits(work / "digits.npz")
        chosen = workloads(on_gpu, digits, tiny=args.host_overhead)
        for key in args.workloads.split(","):
            w = chosen[key]
            plain = Plain(w, device, precision, total, args.log_every)
            ours = Ours(w, device, precision, total, args.log_every, work)
            plain.run(warmup)
            ours.run(warmup)
            ratios, rates, syncs = [], {"plain": [], "ours": []}, []
            for r in range(args.rounds):
                order = [("plain", plain), ("ours", ours)] if r % 2 == 0 else [("ours", ours), ("plain", plain)]
                got = {label: timed(loop, steps, device, syncs if label == "ours" else None) for label, loop in order}
                for label, rate in got.items():
                    rates[label].append(rate)
                ratios.append(got["ours"] / got["plain"])
            ours.close()
            med = statistics.median(ratios)
            print(f"{key:10s} batch {w.batch:4d}: plain {statistics.median(rates['plain']):8.1f} steps/s, "
                  f"ours {statistics.median(rates['ours']):8.1f} steps/s; ours/plain median {med:.3f} "
                  f"(rounds {min(ratios):.3f}..{max(ratios):.3f})" + (f"; host-device syncs in ours' timed steps: {sum(syncs)}" if on_gpu else ""),
                  flush=True)
            report["workloads"][key] = {"batch": w.batch, "plain_steps_s": statistics.median(rates["plain"]),
                                        "ours_steps_s": statistics.median(rates["ours"]), "ratio": med, "rounds": ratios,
                                        "syncs": sum(syncs) if on_gpu else None, "sync_sites": dict(SYNC_SITES.most_common(12))}
            if SYNC_SITES:
                print(f"{'':10s} where ours synced: {dict(SYNC_SITES.most_common(12))}", flush=True)
            SYNC_SITES.clear()
            if args.host_overhead:  # time per step is host time here: ours over plain, less one
                extra = statistics.median(1 / r - 1 for r in ratios)
                print(f"{'':10s} extra host time per step: {100 * extra:+.1f} % "
                      f"({1e6 / statistics.median(rates['plain']):.0f} us plain; goal <= 5 %)", flush=True)
            del plain, ours
            if on_gpu:
                torch.cuda.empty_cache()
    dist.destroy_process_group()
    if args.json is not None:
        report.update(device=name, precision=precision, rounds=args.rounds, steps=steps, torch=torch.__version__)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
