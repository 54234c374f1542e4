"""Against Ray Tune (issue 61, "instant start"): one user function run by `campaign launch`
(`training.target`) and by Ray Tune's function trainable, rounds alternating, on this host's
CPU slots (2 concurrent trials on both sides: `cluster.cpu_slots: 2`; Ray's default of one
CPU per trial on the cores it detects).

    .venv/bin/python bench/vs_ray_tune.py --rounds 1                     # every case, cold and warm (~20 min a round here)
    .venv/bin/python bench/vs_ray_tune.py --cases trivial8 --modes cold --rounds 1
    .venv/bin/python bench/vs_ray_tune.py --dry-run                      # builds every spec and Tune config, runs nothing

Ray is a bench-only extra, which `make test` does not install: `.venv/bin/pip install -c
constraints.txt -e '.[bench]'`. `--sides campaign --warm-sides campaign` and `--dry-run` need no Ray.

The function (`user_loop`): an MLP on sklearn's digits (64 -> width -> width -> 10, SGD, batch
128), reporting val_loss every 25 steps and saving every 50, through the campaign's context
or a thin adapter to Tune's (`RayContext`: a save goes with the next `tune.report`).
Cases (`--cases`): `trivial8`, `trivial32` (trials of 2 steps, a grid of learning rates);
`grid` (2 learning rates x 2 widths, 300 steps); `asha` (16 learning rates drawn once,
log-uniform, the same on both sides, 300 steps, ASHA from step 25 with factor 3); `resume`
(the grid, SIGKILLed, its command's whole process group, once 60 % of its steps are
reported, then `campaign resume` / `Tuner.restore(...).fit()`).

Sides (`--sides`): `campaign`; `ray` (Tune's defaults: `reuse_actors=False`) and `ray-reuse`
(`reuse_actors=True`). Modes (`--modes`): `cold`, every command a fresh process, no server
running: the campaign's launch starts its folder's resident Prefect server (stopped after each
run, not counted), Tune starts Ray's cluster itself; `warm`, the servers already up: the
folder's resident Prefect server (started by a launch that is not counted; each counted
command is run by the server's spare launch and takes its spare MLflow hub and workers' zygote,
forked copies of them: the first counted launch waits for the server to have made them) and Ray's cluster (`ray start --head`,
each driver connects to it). Each tool's warm server runs only during its own runs. Each
mode's campaigns share one project folder (its Prefect and MLflow databases), as a user's do.

Figures per run, from the wall clock around the commands and the timestamps the function
writes itself (its first step in each process, each report, before the tool sees it):
`wall` the command's start to its exit (resume: the launch until the kill, plus the resume);
`first` the command's start to the first trial's first step (resume: the resume's start to
its first step); `gap` the median handover: a trial's last report to the next trial's first
step, the i-th end paired with the (i+2)-th start (2 slots: a device left idle with nothing
to start counts in it); `gap in one process` the same from each trial's end to the next
first step in its own process (warm workers, reused actors: the handover alone); `best` (asha) the lowest final
val_loss of the trials that ran all their steps; `lost` (resume) steps reported before the
kill and trained again after it.

Goals (issue 61): campaign <= 0.5x Ray's wall cold (Tune's defaults), <= 0.8x warm Ray with
reuse_actors; first step <= Ray's; gap <= 0.05 s median. Before the counted rounds each tool
runs one trivial campaign that is not counted (a user's first run: Prefect's database, Ray's
first start). Prints every run and a table of medians; passes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOTS = 2
MARK_ENV = "VS_RAY_TUNE_RUN"  # in every process the bench starts: what is left after a run is found by it
TARGET = "bench.vs_ray_tune:user_loop"
CLI = [sys.executable, "-m", "flows.cli"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    name: str
    lrs: tuple[float, ...]
    widths: tuple[int, ...] = (64,)
    steps: int = 300
    report_every: int = 25
    save_every: int = 50
    asha: bool = False
    kill_at: float | None = None  # share of the grid's steps reported when the command is killed

    @property
    def trials(self) -> int:
        return len(self.lrs) * len(self.widths)

    def kwargs(self, data: Path, marks: Path) -> dict:
        return {"data": str(data), "marks": str(marks), "report_every": self.report_every, "save_every": self.save_every}


def _drawn_lrs(n: int, low: float = 1e-3, high: float = 1.0, seed: int = 0) -> tuple[float, ...]:
    rng = random.Random(seed)
    return tuple(round(math.exp(rng.uniform(math.log(low), math.log(high))), 6) for _ in range(n))


def _trivial(n: int) -> Case:
    return Case(name=f"trivial{n}", lrs=tuple(round(0.01 * (i + 1), 4) for i in range(n)), steps=2, report_every=1, save_every=2)


CASES = {c.name: c for c in (
    _trivial(8), _trivial(32),
    Case(name="grid", lrs=(0.02, 0.1), widths=(256, 512)),
    Case(name="asha", lrs=_drawn_lrs(16), widths=(256,), asha=True),
    Case(name="resume", lrs=(0.02, 0.1), widths=(256, 512), kill_at=0.6),
)}
ASHA = {"min_steps": 25, "reduction_factor": 3}


# --- the user function: the same on both sides ------------------------------------------------

def _mark(marks: str, trial: str, event: str, step: int, **values: float) -> None:
    with open(Path(marks) / f"{trial}.jsonl", "a") as f:
        f.write(json.dumps({"event": event, "t": time.time(), "step": step, "pid": os.getpid(), **values}) + "\n")


def user_loop(ctx, lr: float = 0.05, width: int = 64, batch_size: int = 128, report_every: int = 25, save_every: int = 50,
              data: str = "", marks: str = "") -> None:
    """An MLP on digits, written against the campaign's context (`ctx.load/save/report/should_stop`);
    Ray runs it through `RayContext`. Marks its first step and each report before the tool sees it."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    with np.load(data) as f:
        x, y = torch.from_numpy(f["train_x"]).flatten(1), torch.from_numpy(f["train_y"])
        vx, vy = torch.from_numpy(f["val_x"]).flatten(1), torch.from_numpy(f["val_y"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    step = 0
    if (saved := ctx.load()) is not None:
        step, state = saved
        model.load_state_dict(state["model"]), opt.load_state_dict(state["opt"])
    batches = torch.Generator().manual_seed(step)
    _mark(marks, ctx.trial_id, "first", step)
    while step < ctx.steps:
        i = torch.randint(len(y), (batch_size,), generator=batches)
        loss = F.cross_entropy(model(x[i]), y[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        last = step == ctx.steps
        if step % save_every == 0 or last:
            ctx.save(step, {"model": model, "opt": opt})
        if step % report_every == 0 or last:
            with torch.no_grad():
                val = F.cross_entropy(model(vx), vy).item()
            _mark(marks, ctx.trial_id, "report", step, val_loss=val)
            ctx.report(step, val_loss=val, train_loss=loss.item())
        if ctx.should_stop():  # the campaign's pruner (Ray stops a trial inside its report)
            ctx.save(step, {"model": model, "opt": opt})
            return


class RayContext:
    """The four calls on Ray Tune's function API: a save is sent with the next report, as a
    Tune checkpoint (a folder Tune copies into the trial's storage)."""

    def __init__(self, steps: int):
        from ray import tune

        self.steps, self.trial_id, self._tune, self._pending = steps, tune.get_context().get_trial_id(), tune, None

    def load(self):
        import torch

        checkpoint = self._tune.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as folder:
            saved = torch.load(Path(folder) / "state.pt")
        return saved["step"], saved["state"]

    def save(self, step: int, state: dict) -> None:
        import torch

        self._pending = Path(tempfile.mkdtemp(prefix="tune-save-"))
        torch.save({"step": step, "state": {k: v.state_dict() for k, v in state.items()}}, self._pending / "state.pt")

    def report(self, step: int, **metrics: float) -> bool:
        pending, self._pending = self._pending, None
        checkpoint = self._tune.Checkpoint.from_directory(str(pending)) if pending else None
        self._tune.report({"step": step, **metrics}, checkpoint=checkpoint)
        if pending:
            shutil.rmtree(pending, ignore_errors=True)  # Tune has copied it into the trial's storage
        return False

    def should_stop(self) -> bool:
        return False


def ray_trainable(config: dict) -> None:
    kwargs = {k: v for k, v in config.items() if k != "steps"}
    user_loop(RayContext(config["steps"]), **kwargs)


# --- the two sides' configurations -----------------------------------------------------------

def campaign_spec(case: Case, name: str, folder: Path, data: Path, marks: Path) -> dict:
    grid = {"training.kwargs.lr": list(case.lrs)} | ({"training.kwargs.width": list(case.widths)} if len(case.widths) > 1 else {})
    kwargs = case.kwargs(data, marks) | ({"width": case.widths[0]} if len(case.widths) == 1 else {})
    spec = {
        "campaign": {"name": name, "seed": 0},
        "training": {"target": TARGET, "kwargs": kwargs, "steps": case.steps, "batch_size": 128, "lr": 0.05},
        "grid": grid, "resources": {"devices": 1}, "cluster": {"cpu_slots": SLOTS},
        "tracking": {"mlflow_uri": f"sqlite:///{folder}/mlflow.db", "runs_dir": str(folder / "runs"),
                     "summary": str(folder / f"{name}.json")},
    }
    if case.asha:
        spec["early_stopping"] = {"rule": "asha", "metric": "val_loss", "mode": "min", **ASHA}
    return spec


def ray_job(case: Case, name: str, folder: Path, data: Path, marks: Path, reuse: bool, restore: bool = False) -> dict:
    """What a Ray driver process is handed (JSON): it builds the Tuner from it (`tuner_of`)."""
    return {"case": case.name, "name": name, "storage": str(folder / "ray_results"), "data": str(data), "marks": str(marks),
            "reuse": reuse, "restore": restore}


def tuner_of(job: dict):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    case = CASES[job["case"]]
    if job["restore"]:
        return tune.Tuner.restore(str(Path(job["storage"]) / job["name"]), trainable=ray_trainable, resume_errored=True)
    space = {"steps": case.steps, "lr": tune.grid_search(list(case.lrs)),
             **case.kwargs(Path(job["data"]), Path(job["marks"]))}
    space["width"] = tune.grid_search(list(case.widths)) if len(case.widths) > 1 else case.widths[0]
    scheduler = {"metric": "val_loss", "mode": "min",
                 "scheduler": ASHAScheduler(time_attr="step", max_t=case.steps, grace_period=ASHA["min_steps"],
                                            reduction_factor=ASHA["reduction_factor"])} if case.asha else {}
    return tune.Tuner(ray_trainable, param_space=space, tune_config=tune.TuneConfig(reuse_actors=job["reuse"], **scheduler),
                      run_config=tune.RunConfig(storage_path=job["storage"], name=job["name"]))


def ray_driver(job: dict) -> None:
    """One Tune command in this process: Tune starts Ray itself unless RAY_ADDRESS names a cluster."""
    results = tuner_of(job).fit()
    if results.errors:
        raise SystemExit(f"{len(results.errors)} trials failed: {results.errors[0]}")


# --- processes ------------------------------------------------------------------------------

def base_env(token: str, work: Path) -> dict[str, str]:
    """Both tools' settings are their defaults, but for what keeps a run to itself on a shared
    host: the campaign's lease store (other users' campaigns hold no slot of ours) and Ray's
    temporary folder (a cold Tune starts its own cluster, never another one it finds)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", MARK_ENV: token,
           "CAMPAIGN_LEASE_DB": str(work / "leases.db"), "RAY_TMPDIR": str(work / "ray")}
    # Python's default too: bytecode cached (PYTHONDONTWRITEBYTECODE, set on some hosts, makes every
    # process compile the project's changed modules again; the tools' own are compiled at install).
    for key in ("PREFECT_API_URL", "RAY_ADDRESS", "PYTHONDONTWRITEBYTECODE"):
        env.pop(key, None)
    return env


def marked_processes(token: str) -> list[int]:
    """The processes whose environment carries this bench's token (its own children only)."""
    found, needle = [], f"{MARK_ENV}={token}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def left_over(token: str, servers: set[int]) -> set[int]:
    """The bench's processes but the warm servers and what they started (Ray's pooled workers)."""
    def under_a_server(pid: int) -> bool:
        while pid > 1:
            if pid in servers:
                return True
            pid = _parent(pid)
        return False

    return {pid for pid in marked_processes(token) if not under_a_server(pid)}


def settle(token: str, servers: set[int], wait_s: float = 20.0) -> tuple[float, int]:
    """Waits for what a run left to exit ((seconds waited, processes killed after wait_s)):
    the next run gets the cores to itself."""
    started = time.time()
    while time.time() - started < wait_s:
        if not left_over(token, servers):
            return time.time() - started, 0
        time.sleep(0.1)
    left = left_over(token, servers)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return time.time() - started, len(left)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(cmd: list[str], cwd: Path, env: dict, log: Path, kill_when=None, timeout_s: float = 600) -> tuple[float, float, bool]:
    """(start, end, killed): the command in a process group of its own; `kill_when()` polled
    every 20 ms, True sends SIGKILL to the whole group."""
    with open(log, "ab") as out:
        started = time.time()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            if kill_when is not None and kill_when():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return started, time.time(), True
            if time.time() - started > timeout_s:
                os.killpg(proc.pid, signal.SIGKILL)
                raise SystemExit(f"{' '.join(cmd)} ran past {timeout_s:.0f} s; see {log}")
            time.sleep(0.02)
        ended = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    return started, ended, False


# --- figures --------------------------------------------------------------------------------

def read_marks(marks: Path) -> dict[str, list[dict]]:
    return {p.stem: [json.loads(line) for line in p.read_text().splitlines() if line.strip()] for p in sorted(marks.glob("*.jsonl"))}


def handover_gaps(trials: dict[str, list[dict]], slots: int = SLOTS) -> list[float]:
    """The i-th trial end (its last report) paired with the (i+slots)-th first step: on `slots`
    devices, the trial that takes the freed one."""
    starts = sorted(min(e["t"] for e in ev if e["event"] == "first") for ev in trials.values())
    ends = sorted(max(e["t"] for e in ev if e["event"] == "report") for ev in trials.values() if any(e["event"] == "report" for e in ev))
    return [starts[i + slots] - ends[i] for i in range(min(len(ends), len(starts) - slots))]


def process_gaps(trials: dict[str, list[dict]]) -> list[float]:
    """Each trial's end (its last report) to the first step of the next trial in the same
    process: the handover itself, apart from a device left idle with nothing staged for it
    (which `handover_gaps` counts too). Only where a tool runs trials one after another in one
    process (the campaign's warm workers, Ray's reused actors)."""
    by_process: dict[int, list[tuple[float, str, str]]] = {}
    for trial, events in trials.items():
        starts = [e for e in events if e["event"] == "first"]
        reports = [e for e in events if e["event"] == "report"]
        for e in starts[:1] + reports[-1:]:
            by_process.setdefault(e["pid"], []).append((e["t"], e["event"], trial))
    gaps = []
    for events in by_process.values():
        events.sort()
        gaps += [b[0] - a[0] for a, b in zip(events, events[1:]) if a[1] == "report" and b[1] == "first" and a[2] != b[2]]
    return gaps


def best_final(trials: dict[str, list[dict]], steps: int) -> tuple[float | None, int]:
    """(lowest val_loss at the last step, trials that reached it)."""
    finals = [e["val_loss"] for ev in trials.values() for e in ev if e["event"] == "report" and e["step"] == steps]
    return (min(finals) if finals else None), len(finals)


def lost_steps(trials: dict[str, list[dict]], killed_at: float, resumed_at: float) -> int:
    lost = 0
    for ev in trials.values():
        before = [e["step"] for e in ev if e["event"] == "report" and e["t"] <= killed_at]
        again = [e["step"] for e in ev if e["event"] == "first" and e["t"] >= resumed_at]
        if before and again:
            lost += max(0, max(before) - min(again))
    return lost


def figures(case: Case, marks: Path, starts: list[float], ends: list[float], killed_at: float | None = None) -> dict:
    trials = read_marks(marks)
    if len(trials) != case.trials:
        raise SystemExit(f"{case.name}: {len(trials)} trials marked a first step, {case.trials} expected ({marks})")
    firsts = [e["t"] for ev in trials.values() for e in ev if e["event"] == "first" and e["t"] >= starts[-1]]
    out = {"wall": sum(e - s for s, e in zip(starts, ends)), "first": min(firsts) - starts[-1] if firsts else None}
    if killed_at is None:
        gaps, in_process = handover_gaps(trials), process_gaps(trials)
        out["gap"] = statistics.median(gaps) if gaps else None
        out["gap_process"] = statistics.median(in_process) if in_process else None
    else:
        out["lost"] = lost_steps(trials, killed_at, starts[-1])
    if case.asha:
        out["best"], out["finished"] = best_final(trials, case.steps)
    return out


def progress_reached(marks: Path, share: float, total: int):
    def reached() -> bool:
        done = 0
        for p in marks.glob("*.jsonl"):
            try:
                done += max((json.loads(line)["step"] for line in p.read_text().splitlines() if '"report"' in line), default=0)
            except (OSError, ValueError):
                continue
        return done >= share * total
    return reached


# --- one run of a side --------------------------------------------------------------------

@dataclass(kw_only=True)
class Bench:
    work: Path
    data: Path
    token: str
    keep: set[int] = field(default_factory=set)  # the warm server's process
    spares_wait_s: list[float] = field(default_factory=list)  # warm: waited before each launch for the server's spares
    ray_address: str | None = None  # warm Ray: the running cluster
    ray_temp: Path | None = None  # its temporary folder
    runs: int = 0

    def fresh(self, label: str) -> tuple[Path, Path]:
        self.runs += 1
        folder = self.work / f"{self.runs:03d}-{label}"
        marks = folder / "marks"
        marks.mkdir(parents=True)
        return folder, marks

    def campaign(self, case: Case, warm: bool) -> dict:
        """In the project folder of its mode: `warm` has its resident Prefect server running;
        in `cold` each run starts it (as the folder's first launch does) and it is stopped after."""
        import yaml

        folder, marks = self.fresh(f"campaign-{case.name}")
        cwd = campaign_folder(self.work, warm)
        name = f"{case.name}-{self.runs}"
        params = cwd / f"{name}.yaml"
        params.write_text(yaml.safe_dump(campaign_spec(case, name, cwd, self.data, marks)))
        env = base_env(self.token, self.work)
        kill = progress_reached(marks, case.kill_at, case.trials * case.steps) if case.kill_at else None
        if warm and (cwd / ".campaign" / "server.json").exists():  # (the first launch starts it: start_resident)
            self.spares_wait_s.append(spares_ready(cwd))
        try:
            s0, e0, killed = run_command([*CLI, "launch", params.name, "--no-live"], cwd, env, folder / "launch.log", kill)
            if not killed:
                return figures(case, marks, [s0], [e0])
            # The resident server the killed launch started lives on, as it does for a user.
            s1, e1, _ = run_command([*CLI, "resume", params.name, "--no-live"], cwd, env, folder / "resume.log")
            return figures(case, marks, [s0, s1], [e0, e1], killed_at=e0)
        finally:
            if not warm:
                run_command([*CLI, "stop-server"], cwd, env, folder / "stop-server.log")

    def ray(self, case: Case, warm: bool, reuse: bool) -> dict:
        folder, marks = self.fresh(f"ray{'-reuse' if reuse else ''}-{case.name}")
        # A head started by `ray start` requires its token by default (Ray 2.60): a driver says it has one.
        env = base_env(self.token, self.work) | ({"RAY_ADDRESS": self.ray_address, "RAY_AUTH_MODE": "token"} if warm else {})
        name = f"{case.name}-{self.runs}"

        def driver(restore: bool) -> list[str]:
            job = ray_job(case, name, folder, self.data, marks, reuse, restore)
            return [sys.executable, "-m", "bench.vs_ray_tune", "--ray-driver", json.dumps(job)]

        kill = progress_reached(marks, case.kill_at, case.trials * case.steps) if case.kill_at else None
        s0, e0, killed = run_command(driver(False), folder, env, folder / "driver.log", kill)
        if not killed:
            return figures(case, marks, [s0], [e0])
        settle(self.token, self.keep)  # a cold cluster's processes gone before the restore starts its own
        s1, e1, _ = run_command(driver(True), folder, env, folder / "restore.log")
        return figures(case, marks, [s0, s1], [e0, e1], killed_at=e0)

    def run(self, side: str, case: Case, warm: bool) -> dict:
        got = self.campaign(case, warm) if side == "campaign" else self.ray(case, warm, reuse=side == "ray-reuse")
        got["settle"], got["killed_left"] = settle(self.token, self.keep)
        return got


# --- warm servers -------------------------------------------------------------------------

def start_server(cmd: list[str], cwd: Path, env: dict, log: Path, ready, timeout_s: float = 120) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    started = time.time()
    while not ready():
        if proc.poll() is not None or time.time() - started > timeout_s:
            stop_server(proc)
            raise SystemExit(f"{' '.join(cmd)} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc


def stop_server(proc: subprocess.Popen, grace_s: float = 15) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # what the server started in its group
    except ProcessLookupError:
        pass
    proc.wait()


def spares_ready(folder: Path, timeout_s: float = 60.0) -> float:
    """Warm: wait until the folder's resident server has its spares ready (imported, offered:
    tasks/spares.py; made once no launch runs, seconds of CPU, and offered again as soon as a
    copy of each serves a launch); the seconds waited."""
    from tasks.spares import KINDS, ready, state_path
    from training.files import read_json

    def made(kind: str) -> bool:
        try:
            state = read_json(state_path(folder, kind))
        except Exception:  # noqa: BLE001 (being written, or none)
            return False
        return isinstance(state, dict) and state.get("pid") is not None and ready(folder, kind) == state["pid"]

    started = time.time()
    while not all(made(kind) for kind in KINDS) and time.time() - started < timeout_s:
        time.sleep(0.1)
    return time.time() - started


def campaign_folder(work: Path, warm: bool) -> Path:
    """The project folder of each mode's campaigns (their resident Prefect server and its database live there)."""
    folder = work / ("campaign-warm" if warm else "campaign-cold")
    folder.mkdir(exist_ok=True)
    return folder


def start_resident(bench: Bench) -> int:
    """The warm folder's resident Prefect server, started by a launch that is not counted; its pid."""
    from training.files import read_json

    folder = campaign_folder(bench.work, warm=True)
    bench.campaign(CASES["trivial8"], warm=True)
    state = read_json(folder / ".campaign" / "server.json")
    if not isinstance(state, dict):
        raise SystemExit(f"no resident Prefect server in {folder} after a launch: see {folder / '.campaign'}")
    return state["pid"]


def start_ray_head(bench: Bench) -> subprocess.Popen:
    """`ray start --head --block` with Ray's defaults, its own temporary folder and port."""
    temp = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))  # Ray's socket paths must stay short
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}", f"--temp-dir={temp}"]
    proc = start_server(cmd, bench.work, base_env(bench.token, bench.work), bench.work / "ray-head.log",
                        lambda: (temp / "ray_current_cluster").exists())
    bench.ray_address, bench.ray_temp = (temp / "ray_current_cluster").read_text().strip(), temp
    return proc


def with_warm(bench: Bench, tool: str, body) -> None:
    if tool == "campaign":
        bench.keep = {start_resident(bench)}
    else:
        proc = start_ray_head(bench)
        bench.keep = {proc.pid}
    time.sleep(3)  # its start-up work done before the first counted run
    try:
        body()
    finally:
        if tool == "campaign":
            folder = campaign_folder(bench.work, warm=True)
            run_command([*CLI, "stop-server"], folder, base_env(bench.token, bench.work), folder / "stop-server.log")
        else:
            stop_server(proc)
        bench.keep = set()
        settle(bench.token, set())
        if bench.ray_temp is not None:
            shutil.rmtree(bench.ray_temp, ignore_errors=True)
        bench.ray_address, bench.ray_temp = None, None


# --- the rounds and the table -------------------------------------------------------------

def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def say(mode: str, r: int, side: str, case: Case, got: dict) -> None:
    parts = [f"wall {got['wall']:.2f} s", f"first step {got['first']:.2f} s"]
    parts += [f"gap {got['gap']:.3f} s"] if got.get("gap") is not None else []
    parts += [f"in one process {got['gap_process']:.3f} s"] if got.get("gap_process") is not None else []
    parts += [f"lost {got['lost']} steps"] if "lost" in got else []
    parts += [f"best val_loss {got['best']:.4f} ({got['finished']} ran all steps)"] if case.asha and got.get("best") else []
    tail = f"; left processes {got['settle']:.1f} s" + (f", {got['killed_left']} killed" if got["killed_left"] else "")
    print(f"{mode} round {r} {case.name:9s} {side:9s}: {', '.join(parts)}{tail} (load {load()})", flush=True)


def one_round(bench: Bench, mode: str, r: int, cases: list[Case], sides: list[str], results: dict) -> None:
    """Every case once per side; the sides' order turns each case and each round."""
    for i, case in enumerate(cases):
        turn = (r + i) % len(sides)
        for side in sides[turn:] + sides[:turn]:
            results.setdefault((mode, case.name, side), []).append(got := bench.run(side, case, warm=False))
            say(mode, r, side, case, got)


def warm_round(bench: Bench, r: int, cases: list[Case], sides: list[str], results: dict) -> None:
    """Each tool's warm servers up for its own runs only; which tool goes first turns each round."""
    tools = [t for t in ("campaign", "ray") if any(s.startswith(t) for s in sides)]
    for tool in tools if r % 2 == 0 else tools[::-1]:
        mine = [s for s in sides if s.startswith(tool)]

        def body() -> None:
            for i, case in enumerate(cases):
                turn = (r + i) % len(mine)
                for side in mine[turn:] + mine[:turn]:
                    results.setdefault(("warm", case.name, side), []).append(got := bench.run(side, case, warm=True))
                    say("warm", r, side, case, got)

        with_warm(bench, tool, body)


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def table(results: dict, cases: list[Case], modes: list[str]) -> list[str]:
    """Markdown: per mode and case, each side's medians, then campaign / Ray beside the goals."""
    sides = ["campaign", "ray", "ray-reuse"]
    rays = sides[1:]
    head = ["mode", "case", "side", "rounds", "wall s", "first step s", "gap s (median)", "gap in one process s", "best val_loss / lost steps"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode in modes:
        for case in cases:
            for side in sides:
                got = results.get((mode, case.name, side), [])
                if not got:
                    continue
                extra = fmt(median([g.get("best") for g in got]), 4) if case.asha else (fmt(median([g.get("lost") for g in got]), 0) if case.kill_at else "")
                rows.append(f"| {mode} | {case.name} | {side} | {len(got)} | {fmt(median([g['wall'] for g in got]))} | "
                            f"{fmt(median([g['first'] for g in got]))} | {fmt(median([g.get('gap') for g in got]), 3)} | "
                            f"{fmt(median([g.get('gap_process') for g in got]), 3)} | {extra} |")
            rows += ratio_rows(results, mode, case, rays)
    return rows


def _verdict(value: float, goal: float | None, unit: str = "x", digits: int = 2) -> str:
    if goal is None:
        return f"{value:.{digits}f}{unit}"
    return f"{value:.{digits}f}{unit} (goal <= {goal:g}: {'reached' if value <= goal else 'not reached'})"


def ratio_rows(results: dict, mode: str, case: Case, rays: list[str]) -> list[str]:
    """campaign / Ray: wall and first step as ratios of the medians, the campaign's gap against its goal."""
    ours = results.get((mode, case.name, "campaign"))
    rows = []
    for ray in rays:
        theirs = results.get((mode, case.name, ray))
        if not ours or not theirs:
            continue
        goal = {("cold", "ray"): 0.5, ("warm", "ray-reuse"): 0.8}.get((mode, ray))
        wall = median([g["wall"] for g in ours]) / median([g["wall"] for g in theirs])
        first = median([g["first"] for g in ours]) / median([g["first"] for g in theirs])
        gap, in_process = median([g.get("gap") for g in ours]), median([g.get("gap_process") for g in ours])
        rows.append(f"| {mode} | {case.name} | campaign / {ray} | | {_verdict(wall, goal)} | {_verdict(first, 1)} | "
                    f"{_verdict(gap, 0.05, ' s', 3) if gap is not None else ''} | "
                    f"{_verdict(in_process, 0.05, ' s', 3) if in_process is not None else ''} | |")
    return rows


def warm_up(bench: Bench, sides: list[str]) -> None:
    """Not counted: a user's first run of each tool (Prefect's database, Ray's first start)."""
    for side in sides[:2]:  # one Ray side is enough: the other runs the same code
        bench.run(side, CASES["trivial8"], warm=False)


def dry_run(work: Path) -> None:
    """Every case's campaign spec parsed and its function loaded as `campaign launch` would,
    and its Tune job built (the Tuner itself where Ray is installed)."""
    from training.function import load_function
    from training.spec import parse_spec

    data = work / "digits.npz"
    for case in CASES.values():
        spec = parse_spec(campaign_spec(case, case.name, work, data, work))
        load_function({"target": spec.training.target, "kwargs": dict(spec.training.kwargs)})
        job = ray_job(case, case.name, work, data, work, reuse=True)
        try:
            import ray  # noqa: F401
        except ImportError:
            print(f"{case.name}: campaign spec checked, {case.trials} trials; Tune job {json.dumps(job)} (Ray not installed)")
            continue
        tuner_of(job)
        print(f"{case.name}: campaign spec checked, {case.trials} trials; Tuner built")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--sides", default="campaign,ray,ray-reuse", help="the cold runs' sides")
    parser.add_argument("--warm-sides", default="campaign,ray-reuse", help="the warm runs' (the goal there is against reuse_actors)")
    parser.add_argument("--modes", default="cold,warm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="build every spec and Tune config, run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, specs, marks) and print where it is")
    parser.add_argument("--ray-driver", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.ray_driver:
        ray_driver(json.loads(args.ray_driver))
        return
    sys.path.insert(0, str(ROOT))
    if args.dry_run:
        with tempfile.TemporaryDirectory(prefix="vs-ray-dry-") as tmp:
            dry_run(Path(tmp))
        return
    cases, modes = [CASES[c] for c in args.cases.split(",")], args.modes.split(",")
    sides = {"cold": args.sides.split(","), "warm": args.warm_sides.split(",")}
    print(f"command: {' '.join(sys.argv)}\ndate: {time.strftime('%Y-%m-%d %H:%M')}; load {load()}; {os.cpu_count()} cores", flush=True)
    from training.data import prepare_digits

    results: dict = {}
    work = Path(tempfile.mkdtemp(prefix="vs-ray-"))
    bench = Bench(work=work, data=prepare_digits(work / "digits.npz"), token=uuid.uuid4().hex)
    try:
        warm_up(bench, [s for s in ("campaign", "ray-reuse", "ray") if s in sides["cold"] + sides["warm"]])
        for r in range(args.rounds):
            if "cold" in modes:
                one_round(bench, "cold", r, cases, sides["cold"], results)
            if "warm" in modes:
                warm_round(bench, r, cases, sides["warm"], results)
    finally:
        settle(bench.token, set(), wait_s=5)
        print(f"work folder kept: {work}") if args.keep else shutil.rmtree(work, ignore_errors=True)
    print(f"\nmedians of {args.rounds} rounds; load at the end {load()}")
    if bench.spares_wait_s:
        print(f"warm launches waited {min(bench.spares_wait_s):.1f}–{max(bench.spares_wait_s):.1f} s before their start for the "
              f"resident server's spares (not counted)")
    print("\n".join(table(results, cases, modes)))


if __name__ == "__main__":
    main()
