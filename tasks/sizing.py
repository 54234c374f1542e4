"""Size every trial of a campaign: measured memory estimates where `auto` asks for them."""

from __future__ import annotations

from cluster.sizing import MemoryEstimate, SizedRequest, SizingError, measure_memory, size_request
from cluster.types import Inventory
from training.spec import CampaignSpec, TrialSpec
from tasks.grid import Trial

def optimizer_slots(optimizer: dict, lr: float) -> int:
    """Tensors of state the optimizer keeps per parameter (SGD with momentum 1, Adam 2),
    found by stepping it once on a small parameter."""
    import torch

    from training.workload import build_optimizer

    p = torch.nn.Parameter(torch.zeros(8))
    p.grad = torch.ones(8)
    opt = build_optimizer(optimizer, [p], lr)
    opt.step()
    return sum(1 for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.numel() == p.numel())


def estimate_memory(trial: TrialSpec, on_gpu: bool) -> MemoryEstimate:
    """A dry run of the trial's model on its whole global batch of real samples (on the CPU: same bytes)."""
    from tasks.workload import trial_workload
    from training.workload import build_loss, build_model, datasets, sample_batch

    work = trial_workload(trial)
    model = build_model(work["model"])
    train, _ = datasets(work["data"])
    x, y = sample_batch(train, trial.training.batch_size)
    slots = optimizer_slots(work["optimizer"], trial.training.lr)
    return measure_memory(model, x, y, build_loss(work["loss"]), slots, on_gpu)


def size_trials(spec: CampaignSpec, trials: list[Trial], inventory: Inventory) -> dict[str, SizedRequest]:
    """Every trial's request; raises SizingError or PlacementError naming the trial."""
    needs_estimate = spec.resources.devices == "auto" or spec.resources.memory_gb == "auto"
    cache: dict[str, MemoryEstimate] = {}
    sized = {}
    for trial in trials:
        estimate = None
        if needs_estimate:
            key = trial.spec.model.model_dump_json() + trial.spec.data.model_dump_json() + str(trial.spec.training.batch_size)
            if key not in cache:
                try:
                    cache[key] = estimate_memory(trial.spec, on_gpu=inventory.kind == "gpu")
                except Exception as e:  # a model that cannot run its dry run
                    raise SizingError(f"trial {trial.id!r}: the memory estimate failed ({e.__class__.__name__}: {e}); set resources.memory_gb and resources.devices by hand") from e
            estimate = cache[key]
        request = size_request(trial.id, spec.resources.devices, spec.resources.memory_gb, inventory, estimate)
        if request.max_devices > trial.spec.training.batch_size:
            raise SizingError(f"trial {trial.id!r}: {request.max_devices} devices but a global batch of {trial.spec.training.batch_size}: every process needs a sample")
        logical = trial.spec.training.logical_ranks
        if logical is not None and request.max_devices > logical:
            raise SizingError(f"trial {trial.id!r}: sized to {request.max_devices} devices but training.logical_ranks is {logical}: "
                              "every process holds at least one logical rank; raise training.logical_ranks")
        sized[trial.id] = request
    return sized
