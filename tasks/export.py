"""`campaign export`: a finished trial's trained weights as one plain PyTorch file.

A campaign's checkpoints are sharded (torch.distributed.checkpoint), signed and laid out for
resuming, with the optimizer's and the scheduler's state beside the model's. What a researcher
takes away is the model: `export_trial` reads the trial's final checkpoint (the one its signed
result names, verified against its manifest), and writes `torch.save` of a dict that
`torch.load` reads back with its default `weights_only=True`:

    format     "campaign-export/1"
    campaign, trial_id, step (the weights'), metrics (its result's), objective ([metric, min|max])
    model      the model's state_dict (the project's loop), for `build_model(model_spec)`
    model_spec the trial's model section ({"name": ..., fields} or {"target": ..., "kwargs": ...})
    state      what your function saved with `ctx.save` (a function trial), instead of the two above

The file is written whole or not at all (a temporary file renamed over it), and only over a
file that is an export itself: anything else at that path is left as it is.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from tasks.ranking import DEFAULT_OBJECTIVE, best_finished
from tasks.records import CampaignRecord, campaign_dir, campaign_status
from tasks.tracking_store import trial_config
from training.errors import CampaignError
from training.manifest import checkpoint_step, verify
from training.result import result_report

FORMAT = "campaign-export/1"


def default_trial(runs_dir: Path, record: CampaignRecord) -> tuple[str, float]:
    """The campaign's best finished trial by the objective its launch recorded, and its value;
    CampaignError when none has finished with that metric."""
    rows = campaign_status(runs_dir, record.name, record)
    best = best_finished(rows, record.objective)
    if best is None:
        states = ", ".join(f"{r.trial_id} {r.state}" for r in rows) or "no trials"
        raise CampaignError(f"campaign {record.name} has no finished trial with {(record.objective or DEFAULT_OBJECTIVE)[0]} to export ({states}): "
                            "name a trial (`campaign export TRIAL`), or export once one has finished")
    return best


def export_trial(runs_dir: Path, record: CampaignRecord, trial_id: str, out: Path) -> dict[str, Any]:
    """Write trial `trial_id`'s final weights to `out` (see the module's docstring); returns
    what was written but the tensors. CampaignError, naming the file and the fix, when the
    trial has no result, its checkpoint does not verify, or `out` is a file of another kind."""
    import torch

    trial_dir = campaign_dir(runs_dir, record.name) / trial_id
    result, problem = result_report(trial_dir)
    if result is None:
        raise CampaignError(f"trial {trial_id} has no result to export ({problem or 'it has not finished'}): "
                            "export a finished trial (`campaign status` shows them)")
    # The result names its checkpoint by an absolute path on the host that wrote it; the trial's
    # own folder holds it under the same name (a moved project folder still exports).
    checkpoint = trial_dir / "checkpoints" / Path(result["checkpoint"]).name
    config = trial_config(trial_dir)
    if config is None:
        raise CampaignError(f"trial {trial_id} has no trial.json in {trial_dir}: its checkpoint cannot be told apart "
                            f"from another kind's; `campaign resume --rerun {trial_id}` trains it again")
    if not checkpoint.is_dir() and config.checkpoint_remote:
        _pull(config.checkpoint_remote, checkpoint)  # a pool's node wrote it: the remote holds it
    if (why := verify(checkpoint)) is not None:
        raise CampaignError(f"trial {trial_id}'s final checkpoint {checkpoint} does not verify ({why}): "
                            f"`campaign resume --rerun {trial_id}` trains it again")
    _check_ours(out)
    loaded = _load_checkpoint(checkpoint)
    # The weights' step: a pruned trial's last save may be older than the step it stopped at.
    head = {"format": FORMAT, "campaign": record.name, "trial_id": trial_id, "step": checkpoint_step(checkpoint),
            "metrics": {k: float(v) for k, v in result["metrics"].items()},
            "objective": list(record.objective or DEFAULT_OBJECTIVE)}
    if config.function is not None:
        from training.function import state_of_checkpoint

        body = {"state": state_of_checkpoint(loaded)}
    else:
        body = {"model": loaded["trainer"]["model"], "model_spec": dict(config.model)}
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        torch.save({**head, **body}, partial)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return {**head, **({"model_spec": body["model_spec"]} if "model_spec" in body else {})}


def _pull(remote: dict[str, Any], checkpoint: Path) -> None:
    """The checkpoint, from the trial's DVC remote into its own folder (as a resume pulls it),
    where the remote holds it; else left missing, for the check that follows to say so."""
    from training.checkpoint_remote import remote_for

    try:
        remote_for(remote, keep=1).pull_step(checkpoint_step(checkpoint), checkpoint.parent)
    except Exception as e:  # an unreachable remote, a missing object
        raise CampaignError(f"{checkpoint} is not on this machine and could not be pulled from {remote.get('url')} ({e}): "
                            "export where the remote can be read") from None


def _load_checkpoint(checkpoint: Path) -> dict[str, Any]:
    """Everything the checkpoint holds, tensors on the CPU, in this one process."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "loading in a single process": as intended
        return _load_state_dict_from_keys(checkpoint_id=str(checkpoint))


def _check_ours(out: Path) -> None:
    """`out` must be new or an export: a file of anything else is never written over."""
    import torch

    if not out.exists():
        return
    if out.is_dir():
        raise CampaignError(f"{out} is a folder: pass --out FILE (a .pt file to write)")
    try:
        existing = torch.load(out, map_location="cpu", weights_only=True, mmap=True)  # its head is read, not its weights
    except Exception:
        existing = None
    if not isinstance(existing, dict) or existing.get("format") != FORMAT:
        raise CampaignError(f"{out} exists and is not an export of a trial, and was left as it is: "
                            "move it aside or pass another --out")
