"""The campaign's search: an Optuna study in `<runs_dir>/<campaign>/search.journal`.

Trials are drawn one at a time, when the campaign can start one, so a model-based sampler
(TPE) learns from every result before the next draw. Everything lives in the study's
journal (training.pruning.storage), so a campaign killed at any point continues where it was:

- trials told (complete, pruned, failed) stay as they are;
- trials asked but never told (running when the campaign died) are run again under the
  same id, so they resume from their checkpoints;
- the samplers' state is the study's history (TPE), or indexed by trial number (Sobol);
  a random sampler is reseeded by how many trials exist, so it never repeats its draws.

A grid (or a grid with early stopping) is the same study with every point enqueued, in the
order the spec lists them. `seeds: K` runs each point K times (seed + 0..K-1): the repeats
are enqueued right after the first draw.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.errors import CampaignError
from training.layout import CampaignFiles
from training.spec import Choice, CampaignSpec, IntUniform, LogUniform, Uniform
from tasks.grid import Trial, grid_points, make_trial
from training.pruning import build_pruner, storage

POINT, SEED_INDEX, TRIAL = "point", "seed_index", "trial"  # user attributes of an Optuna trial


def study_journal(files: CampaignFiles, name: str) -> str:
    """The campaign's study journal. A study kept in SQLite (`files.sqlite_study`, before the
    journal) is copied into one first, whole, under another name and then renamed: a kill
    leaves no journal or all of it, and the search goes on where it was."""
    journal, kept = files.study, files.sqlite_study
    if not journal.exists() and kept.exists():
        import optuna

        partial = journal.with_name(journal.name + ".partial")
        partial.unlink(missing_ok=True)
        try:
            optuna.copy_study(from_study_name=name, from_storage=f"sqlite:///{kept.resolve()}", to_storage=storage(str(partial)))
        except Exception as e:
            partial.unlink(missing_ok=True)
            raise CampaignError(f"{kept}: could not read the search's study {name!r} ({type(e).__name__}: {e}); "
                                f"move the file aside to start the search afresh") from e
        os.replace(partial, journal)
    return str(journal.resolve())


@dataclass(frozen=True)
class Drawn:
    number: int  # the Optuna trial's number in the study
    storage_id: int  # its id in the storage (what a trainer reports under)
    trial: Trial


class Search:
    def __init__(self, spec: CampaignSpec, root: Path):
        import optuna

        optuna.logging.set_verbosity(logging.WARNING)  # the flow logs what matters, once
        self.spec = spec
        self.metric, self.mode = spec.objective
        root.mkdir(parents=True, exist_ok=True)
        self.path = study_journal(CampaignFiles(root), spec.campaign.name)
        self.strategy = spec.search.strategy if spec.search else "grid"
        self.seeds = spec.search.seeds if spec.search else 1
        stop = spec.early_stopping
        self.pruning_rule = {
            "rule": stop.rule if stop else None, "min_steps": stop.min_steps if stop else 1,
            "reduction_factor": stop.reduction_factor if stop else 3, "max_steps": spec.training.steps,
        }
        self.study = optuna.create_study(
            storage=storage(self.path), study_name=spec.campaign.name, load_if_exists=True,
            direction="maximize" if self.mode == "max" else "minimize", pruner=build_pruner(**self.pruning_rule),
        )
        self.study.sampler = self._sampler(len(self.study.trials))
        self._draws = self._count_drawn()  # kept in memory: the flow asks every loop, the study changes only by ask
        if self.strategy == "grid":
            self._enqueue_grid()
            self.total = len(grid_points(spec)) * self.seeds
        else:
            self.total = spec.search.trials * self.seeds

    def _sampler(self, existing: int):
        import optuna

        seed = self.spec.campaign.seed
        if self.strategy == "sobol":  # indexed by the study's trials: the sequence goes on after a restart
            warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # stable since 3.0, still flagged
            return optuna.samplers.QMCSampler(qmc_type="sobol", scramble=True, seed=seed, warn_independent_sampling=False)
        # Optuna seeds a numpy RandomState, which takes < 2**32: the offset wraps there (the
        # same seeds as before for every campaign.seed below 4294, where it never reached it).
        fresh = (seed * 1_000_003 + existing) % 2**32
        if self.strategy == "tpe":  # it conditions on the history; the offset keeps its random draws fresh
            return optuna.samplers.TPESampler(seed=fresh)
        return optuna.samplers.RandomSampler(seed=fresh)

    def _enqueue_grid(self) -> None:
        """Every grid point x seed the study does not hold yet, in the spec's order."""
        held = {(repr(t.user_attrs.get(POINT)), t.user_attrs.get(SEED_INDEX, 0)) for t in self.study.trials}
        for point in grid_points(self.spec):
            for k in range(self.seeds):
                if (repr(point), k) not in held:
                    self.study.enqueue_trial({}, user_attrs={POINT: point, SEED_INDEX: k})

    def _distributions(self) -> dict[str, Any]:
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        out = {}
        for key, dim in self.spec.search.space.items():
            if isinstance(dim, Choice):
                out[key] = CategoricalDistribution(dim.choice)
            elif isinstance(dim, Uniform):
                out[key] = FloatDistribution(*dim.uniform)
            elif isinstance(dim, LogUniform):
                out[key] = FloatDistribution(*dim.log_uniform, log=True)
            elif isinstance(dim, IntUniform):
                out[key] = IntDistribution(*dim.int_uniform)
        return out

    # --- what the flow asks ------------------------------------------------------------
    def _drawn(self, frozen) -> Drawn:
        point = frozen.user_attrs.get(POINT, frozen.params)
        return Drawn(frozen.number, frozen._trial_id, make_trial(self.spec, dict(point), frozen.user_attrs.get(SEED_INDEX, 0)))

    def unfinished(self) -> list[Drawn]:
        """Trials drawn but never told: running when the campaign stopped. They run again. A
        campaign killed inside `ask` left the trial made but its draw not finished (Optuna
        stores the trial, then each value, then our attributes): the draw is finished now,
        so the trial runs its own point, not the spec's defaults."""
        from optuna.trial import TrialState

        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        return [self._drawn(t) if TRIAL in t.user_attrs else self._finish_draw(self._reopened(t._trial_id)) for t in running]

    def _reopened(self, storage_id: int):
        """A running trial of the study, its values not drawn yet drawn now (one left by an
        interrupted `ask`)."""
        import optuna

        trial = optuna.Trial(self.study, storage_id)
        if self.strategy != "grid" and POINT not in trial.user_attrs:
            for name, dist in self._distributions().items():
                trial._suggest(name, dist)  # as `Study.ask` draws its fixed distributions
        return trial

    def ended(self) -> list[Drawn]:
        """Trials told complete or pruned. The study keeps what it was told; a campaign whose
        result for one is refused or gone runs it again (training.result: re-finalised)."""
        from optuna.trial import TrialState

        return [self._drawn(t) for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
                if TRIAL in t.user_attrs]

    def all_drawn(self) -> list[Drawn]:
        """Every trial drawn so far, in draw order (a campaign's summary covers them all)."""
        from optuna.trial import TrialState

        return [self._drawn(t) for t in self.study.get_trials(deepcopy=False) if t.state != TrialState.WAITING]

    def drawn(self) -> int:
        """Trials drawn so far (told or not), what counts toward `trials`."""
        return self._draws

    def _count_drawn(self) -> int:
        from optuna.trial import TrialState

        return len(self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))

    def remaining(self) -> int:
        return max(0, self.total - self.drawn())

    def ask(self) -> Drawn:
        distributions = {} if self.strategy == "grid" else self._distributions()
        trial = self.study.ask(distributions)
        self._draws += 1
        return self._finish_draw(trial)

    def _finish_draw(self, trial) -> Drawn:
        """A trial just asked for: its repeats enqueued (a fresh draw), its campaign trial named."""
        point = trial.user_attrs.get(POINT, trial.params)
        if SEED_INDEX not in trial.user_attrs:  # a fresh draw: its repeats come next
            trial.set_user_attr(SEED_INDEX, 0)
            for k in range(1, self.seeds):
                self.study.enqueue_trial({}, user_attrs={POINT: dict(point), SEED_INDEX: k})
        drawn = Drawn(trial.number, trial._trial_id, make_trial(self.spec, dict(point), trial.user_attrs.get(SEED_INDEX, 0)))
        trial.set_user_attr(TRIAL, drawn.trial.id)
        return drawn

    def tell(self, number: int, result: dict[str, Any] | None) -> str:
        """Record a trial's end: its objective, pruned, or failed (None). Returns the state told."""
        from optuna.trial import TrialState

        if result is None:
            self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
            return "failed"
        if result.get("pruned"):
            self.study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)
            return "pruned"
        value = result["metrics"].get(self.metric)
        if value is None:
            self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
            return "failed"
        self.study.tell(number, float(value), skip_if_finished=True)
        return "complete"

    def pruning(self, drawn: Drawn) -> dict[str, Any] | None:
        """What the trial's rank 0 needs to report to the study (TrialConfig.pruning)."""
        if self.pruning_rule["rule"] is None:
            return None
        return {"storage": self.path, "study": self.spec.campaign.name, "trial_id": drawn.storage_id,
                "metric": self.metric, **self.pruning_rule}
