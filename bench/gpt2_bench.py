"""GPT-2 124M, bf16, compiled: our trainer against a plain compiled loop, with model FLOPs utilisation.

    python bench/gpt2_bench.py --json gpt2.json             # on a GPU (bench/gpu_suite.py's `gpt2` step)
    .venv/bin/python bench/gpt2_bench.py --dry-run          # a tiny GPT on the CPU, uncompiled: checks the script

The model is transformers' GPT2LMHeadModel built from its config (training.hf:from_config: 12
layers, 12 heads, 768 wide, 1024 positions, the 50257-token vocabulary; no download, no
dropout, as nanoGPT and llm.c train it) on uniformly random tokens
(examples.transformers.text:random_tokens), AdamW (fused on a GPU), bf16 autocast, at a batch
of `--batch` sequences of 1024 tokens. Three loops, rounds alternating in one process:

- plain: what a person writes: `torch.compile(model)`, a random batch gathered on the device,
  forward, loss, backward, step, zero_grad; the loss read every 50 steps;
- plain, reduce-overhead: the same with `torch.compile(model, mode="reduce-overhead")`
  (PyTorch's own CUDA graphs, through cudagraph trees): the other way to graph a step,
  measured beside the trainer's (training/graphs.py says why the trainer captures directly);
- ours: training.trainer.Trainer with `compile: true` and `cuda_graphs: auto` (its step
  captured where it can be: the trial's log says whether it was).

Model FLOPs utilisation = the model's FLOPs per step (torch.utils.flop_counter over one
forward and backward on the meta device: training.flops) x steps/s / the device's measured
bf16 matrix-multiply peak (training.roofline.matmul_peak). Published figures for the same
model are printed beside it (PUBLISHED): they are other hardware (A100) and other code, so
they say where ours stands, not what it must reach.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from gpu_throughput import CONTROL_EVERY, Ours, Workload, init_group, timed  # noqa: E402
from training.flops import mfu, step_flops  # noqa: E402
from training.roofline import matmul_peak  # noqa: E402
from training.workload import build_model, build_objective, build_optimizer, datasets  # noqa: E402

GPT2_124M = {"vocab_size": 50257, "n_positions": 1024, "n_layer": 12, "n_embd": 768, "n_head": 12}
TINY = {"vocab_size": 256, "n_positions": 32, "n_layer": 1, "n_embd": 32, "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}  # the dry run's
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}

# What the two reference implementations publish for GPT-2 124M (looked up 2026-11; both on A100s).
PUBLISHED = {
    "nanoGPT": {
        "source": "https://github.com/karpathy/nanoGPT (README; config/train_gpt2.py)",
        "published": "reproduces GPT-2 (124M) on OpenWebText on one 8xA100 40GB node in about 4 days; "
                     "train_gpt2.py: 12 x 1024 tokens x 40 accumulation = 491,520 tokens an iteration, 600,000 iterations",
        "derived": "~107k tokens/s per A100, ~29 % MFU by nanoGPT's own estimate (6N + 12LHQT FLOPs a token, "
                   "A100 bf16 peak 312 TFLOP/s): 2.95e11 tokens / (4 days x 8 GPUs)",
    },
    "llm.c": {
        "source": "https://github.com/karpathy/llm.c/discussions/481 (Reproducing GPT-2 (124M) in llm.c in 90 minutes for $20)",
        "published": "up to ~60 % model flops utilization; 10B tokens of FineWeb on one 8xA100 80GB SXM node in ~90 minutes",
        "derived": "~230k tokens/s per A100: 1e10 tokens / (5400 s x 8 GPUs)",
    },
}


class Plain:
    """The hand-written compiled loop (mode: torch.compile's mode)."""

    def __init__(self, model_spec: dict, data: dict, batch: int, optimizer: dict, device: torch.device, precision: str,
                 compile_mode: str | None, log_every: int = 50):
        torch.manual_seed(0)
        self.device, self.log_every, self.batch = device, log_every, batch
        model = build_model(model_spec).to(device)
        self.objective = build_objective(model_spec, {"name": "cross_entropy"})
        self.opt = build_optimizer(optimizer, model.parameters(), 6e-4)
        self.model = torch.compile(model, mode=compile_mode) if compile_mode else model
        self.graphs = compile_mode == "reduce-overhead"
        self.dtype = {"bf16": torch.bfloat16}.get(precision)
        train, _ = datasets(data)
        self.x, self.y = (t.to(device) for t in train.tensors)
        self.step = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            idx = torch.randint(len(self.x), (self.batch,), device=self.device)
            if self.graphs:  # cudagraph trees: a new step, so the last one's outputs may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                loss = self.objective(self.model, self.x[idx], self.y[idx])
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            if self.step % self.log_every == 0:
                loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="a tiny GPT on the CPU, uncompiled: checks the script")
    parser.add_argument("--batch", type=int, default=None, help="sequences a step (default: 32 on a GPU, 4 in the dry run)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="timed steps a round (default 30; 10 in the dry run)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first, compilation included (default 20; 10)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and not args.dry_run
    if not on_gpu and not args.dry_run:
        parser.error("no CUDA device here: run on a GPU, or give --dry-run")
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    config, batch = ({**GPT2_124M, **NO_DROPOUT}, args.batch or 32) if on_gpu else ({**TINY, **NO_DROPOUT}, args.batch or 4)
    steps, warmup = args.steps or (30 if on_gpu else 10), args.warmup or (20 if on_gpu else 10)
    if steps % CONTROL_EVERY or warmup % CONTROL_EVERY:
        parser.error(f"--steps and --warmup must be multiples of {CONTROL_EVERY}")
    precision, compiled = ("bf16", True) if on_gpu else ("fp32", False)
    model = {"target": "training.hf:from_config", "kwargs": {"model": "GPT2LMHeadModel", "config": config}, "output": "auto"}
    data = {"target": "examples.transformers.text:random_tokens",
            "kwargs": {"block": config["n_positions"], "vocab": config["vocab_size"], "samples": 4 * batch, "val": batch}}
    optimizer = {"name": "AdamW", "kwargs": {"betas": [0.9, 0.95], "weight_decay": 0.1, **({"fused": True} if on_gpu else {})}}
    init_group(device)
    report: dict = {"device": torch.cuda.get_device_name(device) if on_gpu else "CPU (1 thread)", "torch": torch.__version__,
                    "model": "GPT2LMHeadModel " + json.dumps(config), "batch": batch, "tokens_per_step": batch * config["n_positions"],
                    "precision": precision, "compiled": compiled, "published": PUBLISHED,
                    "note": None if on_gpu else "dry run: a tiny GPT, fp32, uncompiled (inductor's C++ build would take longer "
                                                "than the whole step); MFU against the CPU core's measured fp32 peak"}
    x, y = (t[:batch].to(device) for t in datasets(data)[0].tensors)
    torch.manual_seed(0)
    flops = step_flops(lambda: build_model(model), build_objective(model, {"name": "cross_entropy"}), x, y,
                       model=build_model(model).to(device))
    peak = matmul_peak(device, torch.bfloat16 if precision == "bf16" else torch.float32)
    report.update(flops_per_step=flops, peak_flops=peak)
    total = warmup + args.rounds * steps + CONTROL_EVERY
    with tempfile.TemporaryDirectory() as tmp:
        loops = {"plain": Plain(model, data, batch, optimizer, device, precision, "default" if compiled else None),
                 "ours": Ours(Workload("gpt2", model, data, batch, optimizer, 6e-4), device, precision, total, 50, Path(tmp),
                              compile=compiled, cuda_graphs="auto")}
        if compiled:  # on the CPU there is no CUDA graph to compare
            loops["plain, reduce-overhead"] = Plain(model, data, batch, optimizer, device, precision, "reduce-overhead")
        for loop in loops.values():
            loop.run(warmup)
        rates: dict[str, list[float]] = {name: [] for name in loops}
        for r in range(args.rounds):
            names = list(loops)[r % len(loops):] + list(loops)[:r % len(loops)]  # the order rotates
            for name in names:
                rates[name].append(timed(loops[name], steps, device))
        loops["ours"].close()
    figures = {}
    for name, values in rates.items():
        steps_s = statistics.median(values)
        figures[name] = {"steps_s": steps_s, "tokens_s": steps_s * report["tokens_per_step"], "mfu": mfu(flops, 1 / steps_s, peak),
                         "rounds": values}
    report["loops"] = figures
    report["ours / plain"] = figures["ours"]["steps_s"] / figures["plain"]["steps_s"]
    if "plain, reduce-overhead" in figures:
        report["plain reduce-overhead / plain"] = figures["plain, reduce-overhead"]["steps_s"] / figures["plain"]["steps_s"]
    for name, f in figures.items():
        print(f"{name:24s} {f['steps_s']:8.2f} steps/s  {f['tokens_s']:12,.0f} tokens/s  MFU {100 * f['mfu']:5.1f} %", flush=True)
    print(f"ours / plain: {report['ours / plain']:.3f} (goal >= 0.99); peak {peak / 1e12:.1f} TFLOP/s measured, "
          f"{flops / 1e9:.1f} GFLOP a step")
    for name, ref in PUBLISHED.items():
        print(f"{name}: {ref['published']} ({ref['derived']}) [{ref['source']}]")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
