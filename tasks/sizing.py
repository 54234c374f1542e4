"""Size every trial of a campaign: measured memory estimates where `auto` asks for them."""

from __future__ import annotations

from cluster.sizing import MemoryEstimate, SizedRequest, SizingError, measure_memory, size_request
from cluster.types import Inventory
from flows.spec import CampaignSpec, TrialSpec
from tasks.grid import Trial

INPUT_SHAPE = (1, 8, 8)  # the digits images; the data file is checked separately
NUM_CLASSES = 10


def estimate_memory(trial: TrialSpec, on_gpu: bool) -> MemoryEstimate:
    """A dry run of the trial's model on its whole global batch (on the CPU: same bytes)."""
    import torch
    import torch.nn.functional as F

    from training.models import build_model

    model = build_model(trial.model.name, **trial.model.model_dump(exclude={"name"}))
    batch = trial.training.batch_size
    x = torch.zeros(batch, *INPUT_SHAPE)
    y = torch.zeros(batch, dtype=torch.long)
    slots = 1 if trial.training.momentum > 0 else 0  # SGD keeps one momentum buffer per parameter
    return measure_memory(model, x, y, F.cross_entropy, slots, on_gpu)


def size_trials(spec: CampaignSpec, trials: list[Trial], inventory: Inventory) -> dict[str, SizedRequest]:
    """Every trial's request; raises SizingError or PlacementError naming the trial."""
    needs_estimate = spec.resources.devices == "auto" or spec.resources.memory_gb == "auto"
    cache: dict[str, MemoryEstimate] = {}
    sized = {}
    for trial in trials:
        estimate = None
        if needs_estimate:
            key = trial.spec.model.model_dump_json() + str(trial.spec.training.batch_size)
            if key not in cache:
                try:
                    cache[key] = estimate_memory(trial.spec, on_gpu=inventory.kind == "gpu")
                except Exception as e:  # a model that cannot run its dry run
                    raise SizingError(f"trial {trial.id!r}: the memory estimate failed ({e.__class__.__name__}: {e}); set resources.memory_gb and resources.devices by hand") from e
            estimate = cache[key]
        request = size_request(trial.id, spec.resources.devices, spec.resources.memory_gb, inventory, estimate)
        if request.max_devices > trial.spec.training.batch_size:
            raise SizingError(f"trial {trial.id!r}: {request.max_devices} devices but a global batch of {trial.spec.training.batch_size}: every process needs a sample")
        sized[trial.id] = request
    return sized
