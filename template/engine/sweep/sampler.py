"""The sweep's sampler: Optuna's TPE or random sampler, seeded per trial number, never proposing taken values."""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from template.engine.internals import queued_values

_DRAWS = 10  # proposals from the sweep's sampler, then as many uniform ones, before a finite space is searched
_GRID = 100_000  # the most points of a finite space listed to find one no trial has
_TAKEN = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)


@dataclass(eq=False)
class TrialSeeded(optuna.samplers.BaseSampler):
    """Proposes all of ``space`` at once from a fresh sampler seeded by ``(seed, trial number)``, the same in one go,
    restarted or among workers (Optuna's seeded sampler draws one sequence per process). A proposal equal to another
    trial's values is drawn again; only a finite space whose every point is taken repeats values, and says so."""

    storage: optuna.storages.BaseStorage
    name: str
    space: dict[str, BaseDistribution]
    kind: str  # tpe or random
    seed: int | None
    startup: int  # TPE's random trials first

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self.space)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        # Values a queued trial was given, or that a trial killed while its values were chosen already has, stay.
        fixed = {**queued_values(trial), **trial.params}
        study_id = self.storage.get_study_id_from_name(self.name)  # under hyperband ``study`` is the trial's bracket
        trials = self.storage.get_all_trials(study_id, deepcopy=False, states=_TAKEN)
        taken = {
            _point(search_space, t.params or queued_values(t)): t.number for t in trials if t.number != trial.number
        }
        for attempt in range(2 * _DRAWS):
            # One proposal for the whole space: both samplers (TPE is univariate) choose each option on its own.
            sampler = self._sampler(trial.number, attempt)
            drawn = {k: sampler.sample_independent(study, trial, k, d) for k, d in search_space.items()}
            proposal = {**drawn, **fixed}
            if _point(search_space, proposal) not in taken:
                return proposal
        grid = _grid(search_space, fixed)
        free = [p for p in grid or [] if _point(search_space, p) not in taken]
        if free:
            return random.Random(_seed(self.seed, trial.number, 2 * _DRAWS)).choice(free)
        repeated = taken[_point(search_space, proposal)]
        given = " with the values it was given" if fixed else ""
        why = f"all {len(grid)} points of sweep.space{given} are taken" if grid else f"{2 * _DRAWS} draws found none"
        print(f"Sweep {self.name}: trial {trial.number} repeats the values of trial {repeated} ({why})", flush=True)
        return proposal

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        # Only for an option outside sweep.space, which the driver never suggests.
        return self._sampler(trial.number, 2 * _DRAWS).sample_independent(study, trial, param_name, param_distribution)

    def _sampler(self, number: int, attempt: int) -> optuna.samplers.BaseSampler:
        seed = _seed(self.seed, number, attempt)
        if self.kind == "random" or attempt >= _DRAWS:
            return optuna.samplers.RandomSampler(seed=seed)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=self.startup)


def _seed(seed: int | None, number: int, attempt: int) -> int | None:
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{seed}/{number}/{attempt}".encode()).digest()[:4], "little")


def _point(space: dict[str, BaseDistribution], values: dict[str, Any]) -> tuple | None:
    """``values`` as comparable numbers (a choice's index, a stepped float's step count); None if some are missing."""
    point = []
    for name, distribution in space.items():
        if name not in values:
            return None
        try:
            x = distribution.to_internal_repr(values[name])
        except ValueError:  # not one of the choices
            return None
        if isinstance(distribution, FloatDistribution) and distribution.step:
            x = round((x - distribution.low) / distribution.step)
        point.append(x)
    return tuple(point)


def _grid(space: dict[str, BaseDistribution], fixed: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every point of a finite space that agrees with ``fixed``; None for a continuous or very large space. Optuna's
    BruteForceSampler counts failed trials as taken and queued ones as free, and stops the study when none is left."""
    axes = []
    for name, d in space.items():
        if name in fixed:
            axes.append([fixed[name]])
        elif isinstance(d, CategoricalDistribution):
            axes.append(list(d.choices))
        elif isinstance(d, IntDistribution):
            axes.append(list(range(d.low, d.high + 1, d.step)))
        elif isinstance(d, FloatDistribution) and d.step:
            axes.append([d.low + i * d.step for i in range(round((d.high - d.low) / d.step) + 1)])
        else:
            return None
        if math.prod(len(a) for a in axes) > _GRID:
            return None
    return [dict(zip(space, values, strict=True)) for values in itertools.product(*axes)]
