"""Size every trial of a campaign: measured memory estimates where `auto` asks for them."""

from __future__ import annotations

from dataclasses import replace

from cluster.sizing import MemoryEstimate, SizedRequest, SizingError, device_seconds, measure_memory, packing_pays, size_request, whole_devices
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


def estimate_memory(trial: TrialSpec, on_gpu: bool, device_memory: int = 0) -> MemoryEstimate:
    """A dry run of the trial's model on its whole global batch of real samples, and a
    no-grad forward on an evaluation batch, under the trial's autocast (on the CPU: the same
    bytes). On a GPU, the data sets the feed keeps there (`data.on_device`) count as resident."""
    from training.batches import EVAL_BATCH_MIN, kept_on_device
    from tasks.workload import trial_workload
    from training.trainer import PRECISIONS
    from training.workload import build_model, build_objective, datasets, sample_batch

    work = trial_workload(trial)
    model = build_model(work["model"])
    train, val = datasets(work["data"])
    x, y = sample_batch(train, trial.training.batch_size)
    eval_x, eval_y = sample_batch(val, min(len(val), max(trial.training.batch_size, EVAL_BATCH_MIN)))
    slots = optimizer_slots(work["optimizer"], trial.training.lr)
    on_device = trial.data.on_device
    resident = sum(kept_on_device(d, on_device, device_memory) or 0 for d in (train, val)) if on_gpu else 0
    return measure_memory(model, x, y, build_objective(work["model"], work["loss"]), slots, on_gpu,
                          eval_input=eval_x, eval_target=eval_y,
                          autocast_dtype=PRECISIONS[trial.training.precision], resident_bytes=resident)


def size_trials(spec: CampaignSpec, trials: list[Trial], inventory: Inventory) -> dict[str, SizedRequest]:
    """Every trial's request; raises SizingError or PlacementError naming the trial."""
    # CPU slots are never shared: their memory needs no estimate (and the model is not built).
    needs_estimate = spec.resources.devices == "auto" or (spec.resources.memory_gb == "auto" and inventory.kind != "cpu")
    cache: dict[str, MemoryEstimate] = {}
    sized: dict[str, SizedRequest] = {}
    seconds: dict[str, float] = {}
    for trial in trials:
        estimate = None
        if needs_estimate:
            key = (trial.spec.model.model_dump_json() + trial.spec.data.model_dump_json()
                   + f"{trial.spec.training.batch_size} {trial.spec.training.precision}")
            if key not in cache:
                try:
                    device_memory = max((d.memory_bytes for d in inventory.devices), default=0)
                    cache[key] = estimate_memory(trial.spec, on_gpu=inventory.kind == "gpu", device_memory=device_memory)
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
        if estimate is not None:
            seconds[trial.id] = device_seconds(estimate, trial.spec.training.steps, trial.spec.training.logical_ranks or 1)
    if spec.resources.memory_gb == "auto" and inventory.kind == "gpu" and not packing_pays(list(seconds.values()), expected_trials(spec, trials)):
        # Too little work to share a GPU for: each trial gets whole devices, and warm workers
        # run them back to back (bench/gpu_suite.py measured the default campaign 0.88x packed).
        sized = {tid: replace(r, memory_for=tuple(whole_devices(inventory, m) for m in r.memory_for)) for tid, r in sized.items()}
    return sized


def expected_trials(spec: CampaignSpec, trials: list[Trial]) -> int:
    """How many trials the campaign will run: the grid's, or the search's budget (its trials
    come one at a time)."""
    budget = (spec.search.trials or 0) * spec.search.seeds if spec.search is not None else 0
    return max(len(trials), budget)
