"""`training.reduction: exact` bit for bit on one device (issue 29, the GPU suite's step 3):
one process holding 4 logical ranks against two processes sharing the device, each holding
two, on the same trial (SmallCNN on digits, deterministic algorithms). Four, not two: a sum
of two gradients is the same in either order, so only more ranks than processes can tell an
ordered reduction from DDP's (`--reduction fast` shows the difference it removes).

Two processes cannot share a GPU through NCCL (it refuses two ranks on one device), so here
both worlds talk through gloo, which all-gathers CUDA tensors through the host; the device
does every kernel. On the CPU (`--dry-run` of the suite, or no GPU) the same runs on one core.

    .venv/bin/python bench/exact_on_one_device.py [--steps 200]

Prints whether the final weights are equal bit for bit, and the largest difference; exits 1
when they are not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def worker(config: str) -> None:
    """One process of the trial (under torchrun): the device shared by every local rank."""
    import torch
    import torch.distributed as dist

    from training.config import TrialConfig
    from training.train import train_trial
    from training.trainer import DistEnv

    cfg = TrialConfig.from_file(config)
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        train_trial(cfg, DistEnv.from_environ(), device)
    finally:
        dist.destroy_process_group()


def run(cfg, processes: int) -> None:
    Path(cfg.trial_dir).mkdir(parents=True)
    path = Path(cfg.trial_dir) / "trial.json"
    path.write_text(cfg.to_json())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
                           __file__, "--worker", str(path)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{processes} process(es) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--reduction", default="exact", choices=["exact", "fast"], help="fast: DDP's all-reduce, for contrast")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    import torch

    from training.checkpoint import load_model_weights
    from training.config import TrialConfig
    from training.data import prepare_digits
    from training.workload import build_model

    with tempfile.TemporaryDirectory(prefix="exact-") as tmp:
        digits = prepare_digits(Path(tmp) / "digits.npz")
        weights = {}
        for processes in (1, 2):
            cfg = TrialConfig(trial_id=f"exact-{processes}", seed=3, model={"name": "small_cnn", "width": 16, "dropout": 0.1},
                              data={"path": str(digits)}, logical_ranks=4, reduction=args.reduction, steps=args.steps, batch_size=64,
                              lr=0.05, warmup_steps=20, checkpoint_every=args.steps, eval_every=args.steps, log_every=50,
                              trial_dir=str(Path(tmp) / f"p{processes}"))
            run(cfg, processes)
            result = json.loads(Path(cfg.result_path).read_text())
            weights[processes] = load_model_weights(Path(result["checkpoint"]), build_model(cfg.model)).state_dict()
    equal = all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1])
    largest = max(float((weights[1][k].double() - weights[2][k].double()).abs().max()) for k in weights[1])
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"reduction {args.reduction} on {device}, {args.steps} steps: 1 process x 4 logical ranks vs 2 processes x 2 on one device: "
          f"{'equal bit for bit' if equal else 'NOT equal'} (largest difference {largest:.3g})")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": device, "reduction": args.reduction, "steps": args.steps, "bit_for_bit": equal, "largest_difference": largest}))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
