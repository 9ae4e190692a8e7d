"""What the command line adds to a run, as the run's first lines say it: each object the engine adds (a callback,
a plugin, a logger, a strategy) carries its ``announcement``, and the lines list those of the Trainer's objects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mechanism:
    """One thing the command line adds to a run: what it changes, and the option that switches it off."""

    name: str
    does: str
    off: str


def announcements(trainer: Any) -> list[Mechanism]:
    """The mechanisms of ``trainer``'s objects, in the order they act (strategy, checkpoint writes, loggers,
    callbacks), each once; an object whose ``announcement`` is None is idle in this run."""
    objects = [trainer.strategy, getattr(trainer.strategy, "checkpoint_io", None), *trainer.loggers, *trainer.callbacks]
    found: dict[str, Mechanism] = {}
    for obj in objects:
        mechanism = getattr(obj, "announcement", None)
        if isinstance(mechanism, Mechanism):
            found.setdefault(mechanism.name, mechanism)
    return list(found.values())


def first_lines(trainer: Any, fit: bool) -> str:
    """The run's first lines: the mechanisms that are on, each with how to switch it off."""
    mechanisms = announcements(trainer)
    width = max([len(m.name) for m in mechanisms] + [len("checkpoints")])
    lines = [f"  {m.name:<{width}}  {m.does}  [off: {m.off}]" for m in mechanisms]
    checkpoint = getattr(trainer, "checkpoint_callback", None)
    if fit and checkpoint is not None and getattr(checkpoint, "monitor", None) is None:
        lines.append(
            f"  {'checkpoints':<{width}}  no checkpoint.monitor set: only last.ckpt is kept  "
            "[best too: --checkpoint.monitor=<a logged metric> --checkpoint.mode=min|max]"
        )
    return "\n".join(["Added by the command line [and how to switch each off]:", *lines])
