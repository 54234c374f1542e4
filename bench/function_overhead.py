"""What running your own loop under a campaign costs (issue 28): steps/s of the char-GPT
function loop (examples/workloads/chargpt_loop.py) inside `campaign launch` against the same
function run as a plain script, in alternating rounds, one core each (a trial's CPU slot).

Both sides report every `log_every` steps and save every `save_every`. The plain script's
context prints its reports and `torch.save`s its state; the campaign's sends them to MLflow
and writes verified DCP checkpoints. Each side's rate is taken between its first and last
report, so neither start-up (imports, data, Prefect) counts: that is the campaign's fixed
cost, measured elsewhere (docs/benchmarks.md).

Goal (issue 28): ratio >= 0.98 (median of the rounds). Prints; passes nothing.

    .venv/bin/python bench/function_overhead.py              # 5 rounds of 1000 steps
    .venv/bin/python bench/function_overhead.py --rounds 3 --steps 400
    .venv/bin/python bench/function_overhead.py --resize     # the pause of a 2 -> 1 resize (checkpoint-restart)
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

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = {"block": 64, "layers": 2, "dim": 64, "heads": 2, "dropout": 0.0, "chars": 400_000, "batch_size": 16,
         "eval_every": 100_000, "eval_batches": 1}  # no evaluation inside the timed window: both sides train only
TIMES_ENV = "FUNCTION_OVERHEAD_TIMES"


class _Timed:
    """Wraps a context so that each report's wall time is kept (both sides, the same way)."""

    def __init__(self, ctx):
        self._ctx, self.times = ctx, []

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def report(self, step, **metrics):
        self.times.append((step, time.perf_counter()))
        return self._ctx.report(step, **metrics)


def timed_train(ctx, **kwargs):
    """The target both sides run: the example's loop, its report times written at the end."""
    from examples.workloads.chargpt_loop import train

    timed = _Timed(ctx)
    train(timed, **kwargs)
    if ctx.rank == 0:
        Path(os.environ[TIMES_ENV]).write_text(json.dumps(timed.times))


class ScriptContext:
    """The plain script's context: one process, prints its reports, torch.save's its state."""

    def __init__(self, steps: int, folder: Path):
        import torch

        self.config, self.rank, self.world_size, self.local_rank = {"seed": 0}, 0, 1, 0
        self.device, self.steps, self.trial_id, self.folder = torch.device("cpu"), steps, "plain", folder

    def report(self, step, **metrics):
        print(f"step {step}: " + ", ".join(f"{k} {float(v):.4f}" for k, v in metrics.items()), flush=True)
        return False

    def save(self, step, state):
        import torch

        plain = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
        torch.save({"step": step, "state": plain}, self.folder / "checkpoint.pt")

    def load(self):
        return None

    def should_stop(self):
        return False


def plain_main(steps: int, folder: Path, kwargs: dict) -> None:
    import torch

    os.sched_setaffinity(0, {0})  # one core, as a trial's CPU slot
    torch.set_num_threads(1)
    torch.manual_seed(0)
    timed_train(ScriptContext(steps, folder), **kwargs)


def rate(times_file: Path) -> float:
    """Steps per second between the first and the last report."""
    times = json.loads(times_file.read_text())
    (s0, t0), (s1, t1) = times[0], times[-1]
    return (s1 - s0) / (t1 - t0)


def run_plain(steps: int, kwargs: dict, folder: Path) -> float:
    times = folder / "plain-times.json"
    env = {**os.environ, TIMES_ENV: str(times), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, __file__, "--plain", json.dumps({"steps": steps, "folder": str(folder), "kwargs": kwargs})],
                   check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return rate(times)


def run_campaign(steps: int, kwargs: dict, folder: Path, round_: int) -> float:
    times = folder / "campaign-times.json"
    name = f"overhead-{round_}"
    spec = {
        "campaign": {"name": name},
        "training": {"target": "bench.function_overhead:timed_train", "kwargs": kwargs, "steps": steps, "batch_size": kwargs["batch_size"],
                     "lr": 0.001},
        "resources": {"devices": 1}, "cluster": {"cpu_slots": 1},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"), "summary": str(folder / f"{name}.json"),
                     "system_metrics_every_s": 10},
    }
    params = folder / f"{name}.yaml"
    params.write_text(yaml.safe_dump(spec))
    env = {**os.environ, TIMES_ENV: str(times), "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "launch", str(params), "--no-live"], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"campaign failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return rate(times)


def run_resize(folder: Path, steps: int, kwargs: dict) -> dict:
    """An elastic [1, 2] function trial on 2 CPU slots, resized 2 -> 1 by hand once it has
    trained a while: its resize event (pause and where it went), from resizes.jsonl."""
    from training.files import read_json
    from training.layout import trial_files

    name = "resize"
    spec = {
        "campaign": {"name": name},
        "training": {"target": "examples.workloads.chargpt_loop:train", "kwargs": kwargs, "steps": steps,
                     "batch_size": kwargs["batch_size"], "lr": 0.001},
        "resources": {"devices": [1, 2]}, "cluster": {"cpu_slots": 2},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"), "summary": str(folder / f"{name}.json")},
    }
    params = folder / f"{name}.yaml"
    params.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    launch = subprocess.Popen([sys.executable, "-m", "flows.cli", "launch", str(params), "--no-live"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = folder / "runs" / name
    trial = None
    while trial is None or (read_json(trial_files(trial).progress) or {}).get("step", 0) < steps // 3:
        if launch.poll() is not None:
            raise SystemExit("the campaign ended before the resize")
        trial = next((p for p in root.iterdir() if p.is_dir()), None) if root.is_dir() else None
        time.sleep(0.2)
    subprocess.run([sys.executable, "-m", "flows.cli", "resize", trial.name, "1", "--runs-dir", str(folder / "runs"), "--wait-s", "120"],
                   env=env, cwd=ROOT, check=True, capture_output=True)
    launch.wait()
    (event,) = [json.loads(line) for line in trial_files(trial).resizes.read_text().splitlines()]
    return event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--resize", action="store_true", help="instead: the pause of a hand resize 2 -> 1 of the function trial")
    parser.add_argument("--plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resize:
        with tempfile.TemporaryDirectory(prefix="function-resize-") as tmp:
            event = run_resize(Path(tmp), args.steps, {**MODEL, "log_every": args.log_every, "save_every": args.save_every})
        parts = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in event["pause_breakdown_s"].items())
        print(f"function trial resized {len(event['from'])} -> {len(event['to'])} by restart: paused {event['pause_s'] * 1000:.0f} ms "
              f"({parts}); {event['latency_s']:.2f} s from the request")
        return
    if args.plain:
        job = json.loads(args.plain)
        plain_main(job["steps"], Path(job["folder"]), job["kwargs"])
        return
    kwargs = {**MODEL, "log_every": args.log_every, "save_every": args.save_every}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="function-overhead-") as tmp:
        for r in range(args.rounds):
            folder = Path(tmp) / f"round{r}"
            folder.mkdir()
            # Alternate which side goes first: a drift of the host's speed then favours neither.
            if r % 2 == 0:
                plain = run_plain(args.steps, kwargs, folder)
                campaign = run_campaign(args.steps, kwargs, folder, r)
            else:
                campaign = run_campaign(args.steps, kwargs, folder, r)
                plain = run_plain(args.steps, kwargs, folder)
            ratios.append(campaign / plain)
            print(f"round {r}: plain {plain:.1f} steps/s, campaign {campaign:.1f} steps/s, ratio {campaign / plain:.3f}", flush=True)
    print(f"function loop in a campaign / plain script: median ratio {statistics.median(ratios):.3f} "
          f"over {args.rounds} rounds (goal >= 0.98); {args.steps} steps, reports every {args.log_every}, saves every {args.save_every}")


if __name__ == "__main__":
    main()
