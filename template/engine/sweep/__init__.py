"""``python -m template sweep`` (an Optuna search whose trials are ``fit`` processes) and ``cv`` (k-fold
cross-validation, a study whose trials are the folds); ``fold_indices``, the split a DataModule folds by.

``study`` runs a command: ``options`` (its section, read by the fit parser), ``driver`` (trials and their folds as
processes, pruning, restarts, workers; ``reporter`` is the trial's side), ``sampler``, ``devices``, ``results``.
Uses ``commands`` and every package below it.
"""

from __future__ import annotations


def main(argv: list[str], command: str = "sweep") -> int:
    """Run or continue the sweep (or the cross-validation, ``cv``) the arguments describe; the exit code."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        from template.engine.errors import ConfigError

        raise ConfigError(f"the {command} needs Optuna; install the extra: pip install -e '.[sweep]'") from None
    from template.engine.sweep.study import run

    return run(argv, command)


def cv_main(argv: list[str]) -> int:
    return main(argv, "cv")
