"""Library output with nothing for the user to do, silenced while a command runs (and only then)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_libraries(*lines: str) -> Iterator[None]:
    """Library warnings and tips with nothing for the user to do (Lightning's cloud adverts), and Lightning's info
    ``lines`` (parts of them) that do not hold where this is used, silenced meanwhile."""
    names = ("utilities.rank_zero", "tuner.batch_size_scaling", "trainer.connectors.checkpoint_connector")
    loggers = [logging.getLogger(f"lightning.pytorch.{name}") for name in names]

    def noise(record: logging.LogRecord) -> bool:
        return not any(line in record.getMessage() for line in ("Tip: For seamless cloud", *lines))

    for logger in loggers:
        logger.addFilter(noise)
    try:
        with warnings.catch_warnings():
            # Lightning trips over its own deprecation in torch's pytree, torchdata over torch's; evaluating a
            # checkpoint logs into a new version folder, and Lightning warns that the old one is not reused.
            for message in (
                r".*isinstance\(treespec, LeafSpec\)",
                r"'set_vital' is deprecated",
                "The dirpath has changed from",
            ):
                warnings.filterwarnings("ignore", message=message)
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(noise)
