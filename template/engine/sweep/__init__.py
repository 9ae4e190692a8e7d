"""``python -m template sweep --config configs/sweep.yaml``: an Optuna search whose trials are real ``fit`` runs.

Modules: ``options`` (the ``sweep:`` section), ``fitconfig`` (each trial's config, by the fit parser),
``reporter`` (the trial's callback writing the objective per validation), ``driver`` (trials as processes,
pruning, restarts, several workers), ``results`` (table, ``best.yaml``, plots), ``study`` (Optuna's storage),
``cv`` (k-fold cross-validation: a study whose trials are the folds).
"""

from __future__ import annotations

import sys


def main(argv: list[str], command: str = "sweep") -> int:
    """Run or continue the sweep (or the cross-validation, ``cv``) the arguments describe; the exit code."""
    try:
        import optuna  # noqa: F401
    except ImportError:
        from template.engine.errors import ConfigError

        raise ConfigError(f"the {command} needs Optuna; install the extra: pip install -e '.[sweep]'") from None
    from template.engine.sweep import cv

    return cv.run_cv(argv) if command == "cv" else cv.run_sweep(argv)


def cv_main(argv: list[str]) -> int:
    return main(argv, "cv")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
