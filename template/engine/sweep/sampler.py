"""The sweep's sampler: Optuna's TPE or random sampler, seeded per trial number, never proposing taken values.

Optuna's seeded sampler draws one sequence per process: restarted, it proposes finished trials' values again, and
workers with one seed propose the same values at once. Here a fresh sampler seeded from ``(sweep.seed, trial number)``
draws each trial's proposal, the same for a number in one go, restarted, or shared by workers (other numbers).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from template.engine.internals import queued_values

_DRAWS = 10  # proposals from the sweep's sampler, then as many uniform ones, before a finite space is searched
_GRID = 100_000  # the most points of a finite space listed to find one no trial has
_TAKEN = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)


class TrialSeeded(optuna.samplers.BaseSampler):
    """Proposes all of ``space`` at once (Optuna's relative sampling), for the trial's number and the study's history.

    A proposal equal to the values of another trial (finished, running or queued) is drawn again with another seed
    derived from the number; only a finite space whose every point is taken repeats values, and says so.
    """

    def __init__(
        self,
        storage: optuna.storages.BaseStorage,
        name: str,
        space: dict[str, BaseDistribution],
        kind: str,
        seed: int | None,
        startup: int,
    ) -> None:
        self.storage, self.name, self.space = storage, name, space
        self.kind, self.seed, self.startup = kind, seed, startup

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self.space)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        # Values a queued trial was given, or that a trial killed while its values were chosen already has, stay.
        fixed = {**queued_values(trial), **trial.params}
        # Every trial of the study: under the hyperband pruner ``study`` holds only the trial's bracket.
        study_id = self.storage.get_study_id_from_name(self.name)
        trials = self.storage.get_all_trials(study_id, deepcopy=False, states=_TAKEN)
        others = [t for t in trials if t.number != trial.number]
        taken = {_point(search_space, _values(t)): t.number for t in others}
        for attempt in range(2 * _DRAWS):
            proposal = {**_draw(self._sampler(trial.number, attempt), study, trial, search_space), **fixed}
            if _point(search_space, proposal) not in taken:
                return proposal
        grid = _grid(search_space, fixed)
        free = [p for p in grid or [] if _point(search_space, p) not in taken]
        if free:
            return random.Random(seed_for(self.seed, trial.number, 2 * _DRAWS)).choice(free)
        repeated = taken[_point(search_space, proposal)]
        given = " with the values it was given" if fixed else ""
        why = f"all {len(grid)} points of sweep.space{given} are taken" if grid else f"{2 * _DRAWS} draws found none"
        print(f"Sweep {self.name}: trial {trial.number} repeats the values of trial {repeated} ({why})", flush=True)
        return proposal

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        # Only for an option outside sweep.space (the driver suggests none): a uniform draw for the trial's number.
        return self._sampler(trial.number, 2 * _DRAWS).sample_independent(study, trial, param_name, param_distribution)

    def _sampler(self, number: int, attempt: int) -> optuna.samplers.BaseSampler:
        seed = seed_for(self.seed, number, attempt)
        if self.kind == "random" or attempt >= _DRAWS:
            return optuna.samplers.RandomSampler(seed=seed)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=self.startup)


def seed_for(seed: int | None, number: int, attempt: int) -> int | None:
    """The seed of one draw for one trial: a function of the sweep's seed and the trial's number only."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{seed}/{number}/{attempt}".encode()).digest()[:4], "little")


def _draw(
    sampler: optuna.samplers.BaseSampler, study: optuna.Study, trial: FrozenTrial, space: dict[str, BaseDistribution]
) -> dict[str, Any]:
    """One proposal of ``sampler`` for the whole space, as Optuna's trial asks it: relative first, then per option."""
    inferred = sampler.infer_relative_search_space(study, trial)
    values = sampler.sample_relative(study, trial, {k: d for k, d in inferred.items() if k in space})
    for name, distribution in space.items():
        if name not in values:
            values[name] = sampler.sample_independent(study, trial, name, distribution)
    return values


def _values(trial: FrozenTrial) -> dict[str, Any]:
    return trial.params or queued_values(trial)


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
    """Every point of a finite space that agrees with ``fixed``; None for a continuous or very large space."""
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
