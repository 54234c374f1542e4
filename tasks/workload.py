"""A trial's workload (model, data, loss, optimizer) as the trainer builds it, and the check
that every distinct one builds and trains on real samples before a campaign starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.layout import CampaignFiles
from training.spec import TrialSpec
from tasks.grid import Trial
from training.errors import CampaignError


def trial_function(spec: TrialSpec) -> dict[str, Any]:
    """A function trial's TrialConfig fields (training.function): the target with its kwargs,
    and the trial's whole spec for ctx.config; nothing for a trial of the project's loop."""
    if spec.training.target is None:
        return {}
    return {"function": {"target": spec.training.target, "kwargs": dict(spec.training.kwargs)}, "point": spec.model_dump(mode="json")}


def trial_workload(spec: TrialSpec, root: Path = Path(".")) -> dict[str, Any]:
    """The plain dicts training.workload builds from (TrialConfig's model, data, loss, optimizer);
    a function trial builds its own: empty model and data."""
    if spec.training.target is not None:
        return {"model": {}, "data": {}, "loss": spec.loss.trial_dict(), "optimizer": spec.optimizer.model_dump(mode="json")}
    model = spec.model.model_dump(mode="json")
    return {
        "model": model,
        "data": spec.data.trial_dict(root),
        "loss": spec.loss.trial_dict(),
        "optimizer": spec.optimizer.model_dump(mode="json"),
    }


def check_trials(trials: list[Trial]) -> None:
    """Build each distinct workload once and run a training step on two real samples; the
    first failure is raised naming the field (and the trial, when the grid varies it)."""
    seen: set[str] = set()
    code: str | None = None  # the project's code, fingerprinted once for every workload
    for trial in trials:
        if trial.spec.training.target is not None:
            code = code_fingerprint() if code is None else code
            _check_function(trial, seen, len(trials) > 1, code)
            continue
        work = trial_workload(trial.spec)
        key = json.dumps(work, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        code = code_fingerprint() if code is None else code
        passed = passed_check(work, trial.spec.training.lr, code)
        if passed.exists():  # this workload passed with this code and data: no model built, torch not imported
            continue
        from training.workload import check_workload  # torch: only when a workload is checked

        try:
            check_workload(**work, lr=trial.spec.training.lr)
        except CampaignError as e:
            where = f"trial {trial.id} ({trial.label}): " if len(trials) > 1 and trial.overrides else ""
            raise type(e)(f"{where}{e}") from None
        passed.parent.mkdir(parents=True, exist_ok=True)
        passed.touch()


CHECK_CACHE_ENV = "CAMPAIGN_CHECK_CACHE"  # where workloads that passed their check are remembered
MAX_FINGERPRINT_ENTRIES = 20_000  # files and folders walked to fingerprint the code


def passed_check(work: dict[str, Any], lr: float | None, code: str) -> Path:
    """The file that says `work` passed its check, named by everything the check depends
    on: the workload, torch's version, the data file and the project's code (`code`:
    code_fingerprint()), so that any edit checks again. In the user's cache folder: every
    campaign of the machine shares it."""
    import hashlib
    import os
    from importlib.metadata import version

    from tasks.mlflow_store import cache_dir

    root = Path(os.environ.get(CHECK_CACHE_ENV) or cache_dir() / "checks")
    digest = hashlib.sha256(json.dumps([work, lr, version("torch"), code], sort_keys=True, default=str).encode())
    data = work.get("data", {}).get("path")
    if data:
        try:
            stat = Path(data).stat()
            digest.update(f"{data}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        except OSError:
            pass
    return root / digest.hexdigest()


def code_fingerprint() -> str:
    """Every Python file of the project and of the folder the campaign runs in (path, size,
    modification time), hashed; a random one where the folders are too large to walk
    quickly, so that their workloads are always checked."""
    import hashlib
    import uuid

    sources = _python_files()
    if sources is None:
        return uuid.uuid4().hex
    digest = hashlib.sha256()
    for path in sources:
        try:
            stat = path.stat()
        except OSError:
            continue
        digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


# Folders of the project that a workload check never runs: an edit there (a test, a bench)
# must not cost the next launch its cached checks (~10 s of imports and model builds).
# (tasks/ too: it only hands the check its workload, which is part of the key.)
NOT_CHECKED = ("tests", "bench", "docs", "flows", "cluster", "schema", "site")
# Folders of the working folder that hold what campaigns wrote, never code: MLflow's default
# artifact folder, and each campaign's own folder (it holds the campaign's record). A folder
# that ran many campaigns holds tens of thousands of their files, past the walk's limit: its
# checks were never remembered.
NO_CODE = ("mlruns",)
NO_CODE_MARK = CampaignFiles(Path(".")).record.name  # a campaign's record marks its folder


def _python_files() -> list[Path] | None:
    """The .py files a workload check can run: the trainer's package (training/) and the working
    folder's own modules (not in hidden folders, virtual environments, the project's
    NOT_CHECKED folders or what campaigns wrote: NO_CODE); None where the folders hold more
    than MAX_FINGERPRINT_ENTRIES."""
    import os

    project = Path(__file__).resolve().parent.parent
    files: list[Path] = []
    seen = 0
    for top in dict.fromkeys([project / "training", Path.cwd().resolve()]):
        for folder, dirs, names in os.walk(top):
            skip = (*NOT_CHECKED, "tasks", "training") if Path(folder) == project else ()  # training/: walked already
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("node_modules", "__pycache__", "venv", *NO_CODE, *skip)
                       and not os.path.exists(os.path.join(folder, d, NO_CODE_MARK))]
            seen += len(names) + len(dirs)
            if seen > MAX_FINGERPRINT_ENTRIES:
                return None
            files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files)


def _check_function(trial: Trial, seen: set[str], several: bool, code: str | None = None) -> None:
    """A function trial's target (and its check hook, in a folder of its own) once per distinct
    one; one that passed with this code (`code`: code_fingerprint()) is remembered, as a
    workload is: a relaunch imports neither the user's module nor torch to check it again."""
    import tempfile

    t = trial.spec.training
    function = trial_function(trial.spec)["function"]
    if t.check:  # the hook runs with the trial's values
        check = {"target": t.check, "kwargs": dict(t.kwargs)}
        what = {"function": function, "check": check, "batch_size": t.batch_size, "seed": trial.spec.seed, "lr": t.lr,
                "checkpoint_every": t.checkpoint_every}
    else:  # the target is imported and its keywords bound, whatever their values: a grid over them is checked once
        check = None
        what = {"function": {"target": function["target"], "keywords": sorted(function["kwargs"])}}
    key = json.dumps(what, sort_keys=True, default=str)
    if key in seen:
        return
    seen.add(key)
    passed = passed_check(what, None, code if code is not None else code_fingerprint())
    if passed.exists():
        return
    from training.config import TrialConfig
    from training.function import check_function  # torch: only when a function is checked

    with tempfile.TemporaryDirectory(prefix="campaign-check-") as folder:
        cfg = TrialConfig(trial_id=trial.id, seed=trial.spec.seed, model={}, data={}, steps=1, batch_size=t.batch_size,
                          lr=t.lr, checkpoint_every=t.checkpoint_every, keep_checkpoints=1, trial_dir=folder,
                          async_checkpoints=False, **trial_function(trial.spec))
        try:
            check_function(cfg.function, check, cfg)
        except CampaignError as e:
            where = f"trial {trial.id} ({trial.label}): " if several and trial.overrides else ""
            raise type(e)(f"{where}{e}") from None
    passed.parent.mkdir(parents=True, exist_ok=True)
    passed.touch()
