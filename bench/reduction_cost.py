"""What `reduction: exact` costs: steps per second of the plain DDP loop, our trainer with
reduction "fast" and our trainer with reduction "exact", side by side in one run.

    .venv/bin/python bench/reduction_cost.py                # defaults: 3 groups x 2 models x 5 runs, ~5.5 min here
    .venv/bin/python bench/reduction_cost.py --groups 1 --models cnn --logical 2 --steps 200   # a quick look, ~40 s

All at 2 processes (torchrun --standalone --nproc-per-node 2, gloo on loopback), each
pinned to one core with one thread, as a trial on two CPU slots runs (ours through
CAMPAIGN_CPU_CORES, the plain loop through its --cores). Per model, the same global batch:

- plain: bench/plain_ddp.py, DDP all-reducing one gradient per step; no logging, no
  checkpoints (for a model other than small_cnn this script is its entry point and hands it
  the model to build: the loop is plain_ddp's, unchanged);
- fast:  our trainer (torchrun -m training.train), `logical_ranks` L, reduction "fast": each
  process runs its L/2 logical ranks one after another, accumulating, and DDP all-reduces
  the sum once per step;
- exact: the same with reduction "exact" (training/exact.py): each logical rank's gradient
  is copied into a slot of its own, the 2 processes all-gather their slots (L gradients in
  all, where fast all-reduces one per process), and each sums the L in logical order.

Ours runs as a campaign runs a fixed-size trial (progress file, asynchronous DCP checkpoints
every --checkpoint-every steps, an evaluation at the last step), MLflow off. Models: "cnn"
(small_cnn width 32: 29k parameters, 10-20 ms steps here) and "mlp" (512 wide, 2 hidden
layers: 301k parameters for less compute, ~8 ms steps, so the gradient traffic, and the
gather of L slots, is a larger share of a step). Global batch 128 for both. At L = 2 each
process holds one logical rank, the plain loop's split exactly; at L = 4 each holds two
(two micro-batches of a quarter of the batch each, and 4 slots gathered): the plain loop
is the same run for both.

Timing is bench/elastic_bench.py's overhead method (its helpers, imported): the window from
step --warm (start-up and first allocations stay out; steps are steady from about step 20)
to the step before the last (ours evaluates at its last step), on the completion time of
every 10th step. Each run is a fresh torchrun (~6 s of start-up here, outside the window),
so the window is kept short and the groups carry the statistics. The plain loop records
the wall time after each optimizer step (--timing-out); ours, with MLflow off, has
no per-step timestamps, so its workers run training.train's main unchanged with
Trainer.train_step wrapped to record the same time.time() after it returns (one list
append per step, what the plain loop does too). The runs of a group (plain, then fast and
exact at each L) go back to back in an order rotating from group to group, so all see the
host's load of the same moment.

How to read it: "ms/step" is the window's wall time per step (checkpoint pauses included),
the median over groups (min..max); "x plain" is the median over groups of each group's
time-per-step ratio to that group's plain run (min..max); "x fast" the same against fast
at the same L: that is the price of exact alone. "typical ms" is the median 10-step
interval per step (checkpoint pauses and bursts of the host's load out); "CPU ms/step" the
user + system time of both workers, every thread, per step (moves less than wall time with
a shared host's load); their "x plain" is the median over groups of the ratio, as above.
On a busy host read the typical and CPU figures: a window's wall time takes every stall.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# A torchrun worker (--worker, below) imports only what its loop needs: with
# torch.distributed.checkpoint imported (elastic_bench's helpers import it), plain_ddp's
# process deadlocks on exit here (torch 2.13, gloo: the process group's destructor joins its
# work thread holding the GIL, while that thread waits for the GIL to free a finished work).
if __name__ != "__main__" or "--worker" not in sys.argv[1:]:
    from rich.console import Console  # noqa: E402
    from rich.table import Table  # noqa: E402

    from bench.elastic_bench import CORES, LAUNCH_ENV, LOG_EVERY, Timing, median, print_header, timing, torchrun  # noqa: E402
    from training.config import TrialConfig  # noqa: E402
    from training.data import prepare_digits  # noqa: E402
    from training.workload import build_model  # noqa: E402

MODELS = {  # name: (model spec, global batch)
    "cnn": ({"name": "small_cnn", "width": 32, "dropout": 0.1}, 128),
    "mlp": ({"name": "mlp", "width": 512, "depth": 2, "dropout": 0.1}, 128),
}
PROCESSES = 2


# --- inside a torchrun worker ------------------------------------------------------------
def worker(argv: list[str]) -> None:
    """`--worker plain --model JSON -- <plain_ddp args>`: plain_ddp's loop on that model;
    `--worker ours --config trial.json --timing-out file`: training.train's main, with each
    step's completion time recorded on rank 0."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=("plain", "ours"), required=True)
    parser.add_argument("--model", help="plain: the model spec (JSON) plain_ddp builds")
    parser.add_argument("--config")
    parser.add_argument("--timing-out", type=Path)
    args, rest = parser.parse_known_args(argv)
    if args.worker == "plain":
        import bench.plain_ddp as plain_ddp
        from training.workload import build_model

        spec = json.loads(args.model)
        plain_ddp.build_model = lambda _small_cnn: build_model(spec)  # its loop, this model
        plain_ddp.main([a for a in rest if a != "--"])
        return

    import training.train
    from training.trainer import Trainer

    done_at: list[float] = []
    train_step = Trainer.train_step

    def timed(self, step, batches):
        loss = train_step(self, step, batches)
        done_at.append(time.time())  # as plain_ddp: the wall time the step's optimizer step completed
        return loss

    Trainer.train_step = timed
    training.train.main(["--config", args.config])
    if int(os.environ.get("RANK", 0)) == 0:
        args.timing_out.write_text(json.dumps({"done_at": done_at}))


# --- the driver ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """What elastic_bench.timing reads (steps, warm, checkpoint_every), for one model."""
    model: str
    steps: int
    warm: int
    checkpoint_every: int


def done_at(path: Path) -> dict[int, float]:
    return {k + 1: t for k, t in enumerate(json.loads(path.read_text())["done_at"])}


def run_plain(work: Path, data: Path, r: Run, name: str) -> Timing:
    spec, batch = MODELS[r.model]
    out = work / f"{name}.json"
    samples = torchrun([str(Path(__file__).resolve()), "--worker", "plain", "--model", json.dumps(spec), "--",
                    "--data", str(data), "--steps", str(r.steps), "--batch-size", str(batch), "--cores", CORES,
                    "--timing-out", str(out)], LAUNCH_ENV, work / f"{name}.log", PROCESSES)
    return timing(done_at(out), samples, r)


def run_ours(work: Path, data: Path, r: Run, name: str, logical: int, reduction: str) -> Timing:
    spec, batch = MODELS[r.model]
    cfg = TrialConfig(trial_id=name, seed=0, model=spec, data={"path": str(data)}, logical_ranks=logical, reduction=reduction,
                      steps=r.steps, batch_size=batch, lr=0.05, warmup_steps=20,  # plain_ddp's defaults
                      checkpoint_every=r.checkpoint_every, log_every=LOG_EVERY, eval_every=r.steps, keep_checkpoints=2,
                      trial_dir=str(work / name), mlflow_run_id=None)
    Path(cfg.trial_dir).mkdir(parents=True)
    config = Path(cfg.trial_dir) / "trial.json"
    config.write_text(cfg.to_json())
    out = work / f"{name}.json"
    samples = torchrun([str(Path(__file__).resolve()), "--worker", "ours", "--config", str(config), "--timing-out", str(out)],
                   {**LAUNCH_ENV, "CAMPAIGN_CPU_CORES": CORES}, Path(cfg.trial_dir) / "train.log", PROCESSES)
    return timing(done_at(out), samples, r, checkpoints=True)


def variants(logicals: list[int]) -> list[tuple[str, int | None, str | None]]:
    """(label, logical ranks, reduction) of every run in a group; plain has neither."""
    return [("plain", None, None)] + [(f"{red} L={n}", n, red) for n in logicals for red in ("fast", "exact")]


def measure(work: Path, data: Path, r: Run, logicals: list[int], groups: int, console: Console) -> list[dict[str, Timing]]:
    names = variants(logicals)
    results = []
    for i in range(groups):
        group = {}
        shift = i % len(names)
        for label, logical, reduction in names[shift:] + names[:shift]:
            tag = f"{r.model}-{label.replace(' ', '').replace('=', '')}-{i}"
            group[label] = run_plain(work, data, r, tag) if logical is None else run_ours(work, data, r, tag, logical, reduction)
        console.print(f"  {r.model}, group {i + 1}/{groups}: " + "; ".join(
            f"{label} {1000 / group[label].window_steps_per_s:.2f}" for label, _, _ in names)
            + f" ms/step (load {os.getloadavg()[0]:.2f})")
        results.append(group)
    return results


def spread(values: list[float], fmt: str) -> str:
    return f"{format(median(values), fmt)} ({format(min(values), fmt)}..{format(max(values), fmt)})"


def wall(t: Timing) -> float:
    return 1 / t.window_steps_per_s


def typical(t: Timing) -> float:
    return t.typical_step_s


def cpu(t: Timing) -> float:
    return t.cpu_per_step_s


def ratios(groups: list[dict[str, Timing]], label: str, base: str, of) -> list[float]:
    """Per group: a time per step (`of` a run) of `label`'s run over `base`'s."""
    return [of(g[label]) / of(g[base]) for g in groups]


def report(console: Console, results: dict[Run, list[dict[str, Timing]]], logicals: list[int]) -> None:
    r0, groups0 = next(iter(results.items()))
    table = Table(title=f"Reduction cost at {PROCESSES} processes, one core each, window steps {r0.warm}-{r0.steps - 1}, "
                        f"{len(groups0)} groups: median over groups (min..max)")
    for col in ("model", "run", "ms/step", "x plain", "x fast (same L)", "typical ms (x plain)", "CPU ms/step (x plain)"):
        table.add_column(col, justify="right")
    for r, groups in results.items():
        params = sum(p.numel() for p in build_model(MODELS[r.model][0]).parameters())
        for label, logical, reduction in variants(logicals):
            def beside_plain(of) -> str:
                ms = f"{median([of(g[label]) for g in groups]) * 1000:.2f}"
                return ms if logical is None else f"{ms} (x{median(ratios(groups, label, 'plain', of)):.3f})"

            table.add_row(f"{r.model} ({params / 1000:.0f}k params, batch {MODELS[r.model][1]})", label,
                          spread([wall(g[label]) * 1000 for g in groups], ".2f"),
                          "-" if logical is None else spread(ratios(groups, label, "plain", wall), ".3f"),
                          spread(ratios(groups, label, f"fast L={logical}", wall), ".3f") if reduction == "exact" else "-",
                          beside_plain(typical), beside_plain(cpu))
    console.print(table)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=3, help="groups of (plain, fast and exact at each L) per model")
    parser.add_argument("--models", default="cnn,mlp", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--logical", default="2,4", help="logical ranks to run ours at, comma-separated (each a multiple of 2)")
    parser.add_argument("--steps", type=int, default=300, help="steps per run")
    parser.add_argument("--warm", type=int, default=50, help="steps left out of the window as start-up")
    parser.add_argument("--checkpoint-every", type=int, default=200, help="ours: an asynchronous checkpoint every this many steps")
    parser.add_argument("--workdir", type=Path, help="keep trials and logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    args.logical = [int(n) for n in args.logical.split(",")]
    if unknown := [m for m in args.models if m not in MODELS]:
        parser.error(f"unknown model(s) {unknown}: choose from {list(MODELS)}")
    if any(n % PROCESSES for n in args.logical):
        parser.error(f"--logical: each must be a multiple of {PROCESSES} (every process holds as many logical ranks)")
    if not 0 <= args.warm < args.steps - 20:
        parser.error("--warm must leave at least 20 steps of the window before --steps")
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        parser.error(f"--workdir {args.workdir} is not empty: finished trials there would be skipped, not measured")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    console = Console(width=160, emoji=False)
    os.environ.update({k: v for k, v in LAUNCH_ENV.items() if k != "OMP_NUM_THREADS"})
    started = time.time()
    print_header(console)
    with tempfile.TemporaryDirectory(prefix="reduction-cost-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = prepare_digits(work / "digits.npz")
        results = {}
        for model in args.models:
            r = Run(model, args.steps, args.warm, args.checkpoint_every)
            results[r] = measure(work, data, r, args.logical, args.groups, console)
        report(console, results, args.logical)
    console.print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; bench took {time.time() - started:.0f} s")


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        worker(sys.argv[1:])
    else:
        main()
