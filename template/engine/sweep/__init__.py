"""``sweep`` (an Optuna search whose trials are ``fit`` processes) and ``cv`` (k-fold cross-validation, a study whose
trials are the folds); ``fold_indices``. ``study`` runs either with ``options``, ``sampler`` and ``driver`` (whose
trials run ``reporter``). Uses ``commands`` and every package below it."""

import importlib.util

from template.engine.errors import ConfigError


def main(argv: list[str], command: str = "sweep") -> int:
    """Run or continue the sweep (or the cross-validation, ``cv``) the arguments describe; the exit code."""
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError(f"the {command} needs Optuna; install the extra: pip install -e '.[sweep]'")
    from template.engine.sweep.study import run

    return run(argv, command)


def cv_main(argv: list[str]) -> int:
    return main(argv, "cv")
