"""Do processes forked from the campaign's zygotes work on this machine's torch, GPU included?

    .venv/bin/python bench/zygote_probe.py                    # here (CPU)
    python bench/zygote_probe.py --json "$OUT/zygotes.json"  # on the lent GPU machine (bench/gpu_suite.py runs it)

A campaign forks its processes from zygotes (training/zygote.py): its warm workers (one-device
trials) from one that imported `training.worker`, an elastic trial's workers from one that
imported `training.elastic_worker` (our agent, one node) or `training.train` (torchrun's agent:
several nodes, or a trial started by `training.launch`). A zygote forks only while the
CUDA driver is not loaded in it (else the children could not use their GPUs) and falls back to a
new process otherwise, silently slower. Here each zygote is started as the campaign starts it;
a child is forked from it that checks its parent is the zygote, then initialises CUDA, runs a
matrix product on the device and waits for it. Beside each, the same child started as a new
interpreter (`python -m`), as it would be without a zygote: seconds from the request to the
child's end, CUDA's start included.

Prints one line per way and writes them to `--json`; exits 1 if a zygote refused to fork or a
forked child failed (on a machine with a GPU: did not run its product there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.zygote import Zygote, ZygoteGone  # noqa: E402

MODULE = "bench.zygote_probe"  # what a zygote forks: this file's main, with --child


def child(out: Path) -> int:
    """In the forked (or new) process: who its parent is, and CUDA used for real."""
    import torch

    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    found = {"forked_by_zygote": "training.zygote" in parent, "cuda": torch.cuda.is_available()}
    if found["cuda"]:
        x = torch.randn(2048, 2048, device="cuda")
        found["product_sum"] = float((x @ x).sum().item())  # .item() waits for the device
        found["device"] = torch.cuda.get_device_name(0)
    out.write_text(json.dumps(found))
    return 0


def forked(preload: str, env: dict[str, str], out: Path) -> dict:
    """A child forked from a zygote that imported `preload`, started with `env`. Two are
    forked one after the other and the second is timed: the first waits for the zygote's
    imports, which a campaign does while it checks the spec and starts Prefect."""
    zygote = Zygote([preload], ROOT, env, new_session=True, output=None)
    try:
        for _ in range(2):
            out.unlink(missing_ok=True)  # what is read is the timed child's
            started = time.perf_counter()
            try:
                process = zygote.fork(MODULE, ["--child", str(out)], env, ROOT)
            except ZygoteGone as e:
                return {"ok": False, "refused": str(e)}
            code = process.wait(timeout=300)
            seconds = time.perf_counter() - started
    finally:
        zygote.close()
    return {**_result(code, out), "seconds": round(seconds, 3)}


def new_process(env: dict[str, str], out: Path) -> dict:
    started = time.perf_counter()
    code = subprocess.run([sys.executable, "-m", MODULE, "--child", str(out)], cwd=ROOT, env=env, timeout=300).returncode
    return {**_result(code, out), "seconds": round(time.perf_counter() - started, 3)}


def _result(code: int, out: Path) -> dict:
    found = json.loads(out.read_text()) if out.exists() else {}
    return {"ok": code == 0 and bool(found), "exit": code, **found}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)

    from training.elastic import WORKER_ENV
    from training.launch import launch_env

    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    ways = {
        # as tasks/trial.py starts the campaign's zygote of warm workers
        "warm worker (zygote of training.worker)": lambda out: forked("training.worker", {**base, **launch_env()}, out),
        # as training/elastic.py (our elastic agent, one node) starts its zygote of workers
        "elastic worker (zygote of training.elastic_worker)": lambda out: forked("training.elastic_worker", {**base, **launch_env(), **WORKER_ENV}, out),
        # as training/launch.py starts a torchrun agent's zygote of trainers: in the agent's
        # environment, the campaign's launch environment (tasks/trial.py: plan_launch)
        "torchrun worker (zygote of training.train)": lambda out: forked("training.train", {**base, **launch_env()}, out),
        "new interpreter (python -m)": lambda out: new_process({**base, **launch_env()}, out),
    }
    report: dict = {"ways": {}}
    with tempfile.TemporaryDirectory(prefix="zygote-probe-") as tmp:
        for i, (name, way) in enumerate(ways.items()):
            found = way(Path(tmp) / f"{i}.json")
            report["ways"][name] = found
            print(f"{name}: {json.dumps(found)}", flush=True)
    # A GPU is one a new interpreter sees (this process imports no torch: it starts the others).
    report["gpu"] = gpu = bool(report["ways"]["new interpreter (python -m)"].get("cuda"))
    zygotes = [v for k, v in report["ways"].items() if "zygote" in k]
    report["ok"] = all(v["ok"] and v.get("forked_by_zygote") and (v.get("cuda") or not gpu) for v in zygotes)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print("ok" if report["ok"] else "FAILED: a zygote did not fork a working child")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
