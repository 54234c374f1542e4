"""The gradient noise scale of the built-in and example workloads, measured by the trainer.

    .venv/bin/python bench/noise_scale.py [--steps default=300 resnet20=200 chargpt=200] [--only NAME ...]

Each workload's spec (params.yaml, examples/resnet.yaml, examples/chargpt.yaml: its base
values, the grid left out) is trained the way a campaign trains a trial, `torchrun
--nproc-per-node 2 -m training.train`, on CPU slots, with two logical ranks, one per
process, so that every step gives two batch sizes of one gradient: each process's half
before DDP's all-reduce and the averaged whole (training.noise_scale). The noise scale is
measured on every step here (`noise_scale_every: 1`; a campaign's trial measures on the step
before each log step) and read from the trial's MLflow run, where the trainer logs it as
`grad_noise_scale` at each log step: its moving average over the first quarter of the
steps ("start") and at the last step ("end", the average of about the last 100 steps).

The results go to cluster/noise_scales.json, where the simulator's workloads
(cluster/workloads.py) read them: {name: {batch_size, noise_scale_start, noise_scale_end,
measured}}, the noise scales in samples. A workload's steps default to fewer than its spec
says (on a 2-core CPU the example models take ~0.5 s a step): the learning-rate schedule is
compressed to them, as a shorter trial's would be.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORKLOADS = {"default": REPO / "params.yaml", "resnet20": REPO / "examples" / "resnet.yaml", "chargpt": REPO / "examples" / "chargpt.yaml"}
STEPS = {"default": 300, "resnet20": 200, "chargpt": 200}
PROCESSES = 2
OUT = REPO / "cluster" / "noise_scales.json"


def trial_config(name: str, spec_path: Path, steps: int, work: Path, digits: Path, tracking_uri: str, run_id: str):
    from training.spec import load_spec
    from tasks.grid import make_trial
    from tasks.workload import trial_workload
    from training.config import TrialConfig

    spec = load_spec(spec_path)
    trial = make_trial(spec, {})  # the spec's base values, no grid point
    t = trial.spec.training
    workload = trial_workload(trial.spec, REPO)
    if "path" in workload["data"]:  # the built-in digits, written by DVC's `prepare` in a campaign
        workload["data"] = {**workload["data"], "path": str(digits)}
    trial_dir = work / name
    return TrialConfig(
        trial_id=name, seed=trial.spec.seed, **workload, steps=steps, batch_size=t.batch_size, lr=t.lr,
        precision=t.precision, grad_clip_norm=t.grad_clip_norm, logical_ranks=PROCESSES, reduction=t.reduction,
        schedule=t.schedule, warmup_steps=min(t.warmup_steps, steps // 10), checkpoint_every=steps, log_every=10,
        eval_every=steps, noise_scale_every=1, trial_dir=str(trial_dir), mlflow_tracking_uri=tracking_uri, mlflow_run_id=run_id,
    )


def run(cfg, log: Path) -> float:
    Path(cfg.trial_dir).mkdir(parents=True, exist_ok=True)
    config = Path(cfg.trial_dir) / "trial.json"
    config.write_text(cfg.to_json())
    cmd = [sys.executable, "-m", "training.launch", "--standalone", f"--nproc-per-node={PROCESSES}", "-m", "training.train", "--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CAMPAIGN_CPU_CORES": ",".join(str(i % (os.cpu_count() or 1)) for i in range(PROCESSES)),
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    started = time.time()
    with open(log, "wb") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    if code != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {code}:\n{log.read_text(errors='replace')[-3000:]}")
    return time.time() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", nargs="*", default=[], help="NAME=STEPS overrides, e.g. resnet20=400")
    parser.add_argument("--only", nargs="*", default=None, help="workloads to run (default: all; the others keep their rows)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    steps = {**STEPS, **{k: int(v) for k, v in (s.split("=") for s in args.steps)}}
    names = args.only or list(WORKLOADS)

    from mlflow import MlflowClient

    from training.data import prepare_digits

    command = "bench/noise_scale.py" + (" " + shlex.join(argv if argv is not None else sys.argv[1:]) if (argv or sys.argv[1:]) else "")
    rows = json.loads(args.out.read_text()) if args.out.exists() else {}
    with tempfile.TemporaryDirectory(prefix="noise-scale-") as tmp:
        work = Path(tmp)
        digits = prepare_digits(work / "digits.npz")
        uri = f"sqlite:///{work / 'mlflow.db'}"
        client = MlflowClient(tracking_uri=uri)
        experiment = client.create_experiment("noise-scale")
        print(f"{'workload':<10} {'batch':>5} {'steps':>5} {'wall s':>7}  {'start (samples)':>15} {'end (samples)':>13}  "
              f"{'start / batch':>13} {'end / batch':>11}")
        for name in names:
            run_id = client.create_run(experiment, run_name=name).info.run_id
            cfg = trial_config(name, WORKLOADS[name], steps[name], work, digits, uri, run_id)
            wall = run(cfg, work / f"{name}.log")
            history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "grad_noise_scale"))
            if not history:
                raise RuntimeError(f"{name}: the trainer logged no grad_noise_scale:\n{(work / f'{name}.log').read_text()[-3000:]}")
            quarter = cfg.steps // 4
            start = next(v for s, v in history if s >= quarter)
            end = history[-1][1]
            b = cfg.batch_size
            print(f"{name:<10} {b:>5} {cfg.steps:>5} {wall:>7.0f}  {start:>15.1f} {end:>13.1f}  {start / b:>13.2f} {end / b:>11.2f}", flush=True)
            print("  logged (step: noise scale): " + ", ".join(f"{s}: {v:.0f}" for s, v in history), flush=True)
            rows[name] = {"batch_size": b, "noise_scale_start": round(start, 2), "noise_scale_end": round(end, 2),
                          "measured": f"{datetime.date.today().isoformat()} {command} (steps {cfg.steps}, start: step {quarter}, "
                                      f"{PROCESSES} processes on CPU)"}
            args.out.write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
