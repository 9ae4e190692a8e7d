"""Exact resume: every process's random states travel in the checkpoint and come back on resume, and a checkpoint
written on the way (a stop, a periodic save) is written only where Lightning resumes exactly."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

from template.engine import internals
from template.engine.logs.console import Mechanism
from template.engine.resume.loader import (
    global_states,
    is_stateful,
    make_resumable,
    not_resumable_reason,
    restore_global_states,
    wrapped,
)
from template.engine.strategies.devices import process_devices


def exact_resume_point(trainer: Trainer) -> bool:
    """Whether a checkpoint written at the end of the training batch that just ended continues exactly: not between
    micro-batches (checkpoints hold no gradients), at an epoch's last batch or right before a validation (Lightning
    resumes from those by skipping the validation or the epoch's end)."""
    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    return not (last or internals.accumulating(trainer) or internals.validation_follows(trainer))


class RNGStateCheckpoint(Callback):
    """Saves torch, CUDA, Python, NumPy and sampler-generator states per rank (tensors and plain values: loaded
    weights-only) and restores them on resume; puts a map-style training DataLoader back at its place in an epoch;
    steps ``ReduceLROnPlateau`` schedulers where the uninterrupted run steps them (the values they monitor travel)."""

    announcement = Mechanism(
        "random states",
        "saved in every checkpoint per process, for an exact resume",
        "always on (it only adds to checkpoints)",
    )

    def __init__(self) -> None:
        self._trainer: Trainer | None = None
        self._batches_done: int | None = None
        self._last_batch = False
        self._restored: dict[str, Any] | None = None
        # Per training loader: the random states its current epoch was drawn from, from the checkpoint.
        self._pending_loaders: list[dict[str, Any] | None] = []
        self._patched: Any = None
        self._ignored: list[Any] = []  # warnings filters this fit added, removed at its end

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage == "fit" and self._patched is None:
            # The training loader becomes its resumable copy after Lightning inserted its samplers and before it makes
            # the first iterator: no callback hook runs there, the (user's) strategy's process_dataloader does.
            strategy = trainer.strategy
            process = strategy.process_dataloader

            def process_dataloader(dataloader: object) -> object:
                dataloader = process(dataloader)
                if trainer.state.stage != RunningStage.TRAINING:
                    return dataloader
                # Lightning sets the samplers' epoch after the first iterator: a DistributedSampler drew epoch 0's.
                _set_epoch(dataloader, trainer.fit_loop.epoch_progress.current.processed)
                return self._resumable(dataloader)

            strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]
            self._patched = strategy

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._patched is not None:
            self._patched.__dict__.pop("process_dataloader", None)  # the class's method is back
            self._patched = None
        warnings.filters[:] = [entry for entry in warnings.filters if entry not in self._ignored]
        self._ignored = []

    def ignore(self, message: str) -> None:
        """Leave out a warning of Lightning's that this fit makes false, until the fit's end."""
        warnings.filterwarnings("ignore", message=message)
        self._ignored.append(warnings.filters[0])

    def _resumable(self, dataloader: object) -> object:
        resumable = make_resumable(dataloader)
        sampler = wrapped(resumable)
        pending = self._pending_loaders.pop(0) if self._pending_loaders else None
        done = self._batches_done
        if sampler is not None and pending is not None and done and not self._last_batch:
            # Restarted in the middle of an epoch: its order again, without the batches already trained on.
            sampler.resume(pending["iterator"], pending["order"], done)
        elif sampler is not None and pending is not None:
            sampler.keep_workers_seed(pending["iterator"])
        return resumable

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        progress = trainer.fit_loop.epoch_loop.batch_progress
        done = progress.current.processed
        # A stop under way: Lightning's own SIGTERM handling, or Preemption's (its signal's time is public).
        stopping = trainer.received_sigterm or any(getattr(c, "signalled_at", None) for c in trainer.callbacks)
        if not stopping or not done or progress.is_last_batch:
            return
        # Said now, not after the restart, where the continuation will differ.
        for index, loader in enumerate(self._train_loaders()):
            reason = not_resumable_reason(loader)
            sampler = wrapped(loader)
            if reason is None and sampler is not None and not sampler.order_reproducible():
                name = type(sampler.inner).__name__
                reason = f"its sampler {name} draws an order that the recorded random states do not draw again"
            if reason is not None:
                name = f"{type(loader).__name__} over {type(getattr(loader, 'dataset', None)).__name__}"
                rank_zero_info(
                    f"Not exact: training loader {index} ({name}) cannot be put back at batch {done} of epoch "
                    f"{trainer.current_epoch}: {reason}; the restart reads this epoch's data again from its start "
                    f"(about {done} batches read twice, as many not read). See docs/reliability.md, Exact at any step."
                )

    def state_dict(self) -> dict[str, Any]:
        """Called on every rank while a checkpoint is assembled; rank 0's copy (holding all ranks) is written."""
        loaders = self._train_loaders()
        state = global_states()
        # By the devices this process trains on, in order: a continuation puts them on its own, however numbered.
        devices = process_devices(self._trainer.strategy)
        state["cuda"] = {str(d): torch.cuda.get_rng_state(d) for d in devices if d.type == "cuda"}
        state["samplers"] = [g.get_state() if g is not None else None for g in _sampler_generators(loaders)]
        state["loaders"] = [_recorded(wrapped(loader)) for loader in loaders]
        metrics = self._trainer.callback_metrics  # what a plateau scheduler steps on at the epoch's end
        state["monitors"] = {k: metrics[k].cpu() for k in _plateau_monitors(self._trainer) if k in metrics}
        ranks: list[Any] = [state]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, state)
        return {"world_size": len(ranks), "ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's generators now; sampler generators once the train dataloader exists."""
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if state_dict["world_size"] != world_size:
            if self._trainer.state.fn == TrainerFn.FITTING:  # an evaluation continues nothing
                rank_zero_warn(
                    f"The checkpoint holds random states of {state_dict['world_size']} processes but this run has "
                    f"{world_size}; random states are not restored, so the resumed run will not repeat the original "
                    "one exactly. Resume with the same number of processes for an exact continuation."
                )
            return
        state = state_dict["ranks"][dist.get_rank() if world_size > 1 else 0]
        state = {**state, "cuda": _on_devices(state.get("cuda"), process_devices(self._trainer.strategy))}
        restore_global_states(state)
        self._restored = state
        self._pending_loaders = list(state.get("loaders") or [])

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # "processed": a checkpoint saved from on_train_batch_end has not counted its batch as completed yet.
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {})
        self._batches_done = progress.get("current", {}).get("processed")
        self._last_batch = bool(progress.get("is_last_batch", False))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loaders = self._train_loaders()
        restored, self._restored = self._restored, None
        trainer.callback_metrics.update({} if restored is None else restored.get("monitors", {}))
        if trainer.fit_loop.resumed_on_epoch_end and pl_module.automatic_optimization:
            # Written in an epoch's on_train_epoch_end, before Lightning stepped plateau schedulers there: the resumed
            # run starts after that epoch's end, so they step now, as Lightning would have.
            for config in trainer.lr_scheduler_configs:
                due = config.interval == "epoch" and trainer.current_epoch % config.frequency == 0
                if config.reduce_on_plateau and due and config.monitor in trainer.callback_metrics:
                    pl_module.lr_scheduler_step(config.scheduler, trainer.callback_metrics[config.monitor])
        # Lightning restores a StatefulDataLoader's place and sampler generator: a new iterator would lose them.
        stateful = bool(loaders) and all(is_stateful(loader) for loader in loaders)
        # A resumable copy replaying its epoch leaves the global generators where its workers' seed was drawn.
        replayed = any((sampler := wrapped(loader)) is not None and sampler.resuming for loader in loaders)
        # At an epoch's end Lightning built the next iterator before setting the samplers' epoch: it is built again.
        at_epoch_end = trainer.fit_loop.restarted_on_epoch_end or trainer.fit_loop.resumed_on_epoch_end
        if at_epoch_end:
            for loader in loaders:
                _set_epoch(loader, trainer.fit_loop.epoch_progress.current.processed)
        if restored is not None and (stateful or replayed or at_epoch_end):
            # Making the restored (at an epoch's end: the next) iterator drew from the global generators, which the
            # uninterrupted run did earlier, from the checkpoint's states.
            restore_global_states(restored)
        # A place in the epoch put back brings its sampler generator with it.
        put_back = (stateful and trainer.fit_loop.restarted_mid_epoch) or replayed
        samplers = [] if restored is None or put_back else restored["samplers"]
        rebuild = at_epoch_end
        for generator, saved in zip(_sampler_generators(loaders), samplers, strict=False):
            if generator is not None and saved is not None:
                generator.set_state(saved)
                rebuild = True
        if rebuild:
            # Lightning built the epoch's iterator before this hook: a new one draws from the restored states.
            iter(internals.fit_data_fetcher(trainer))
        # A resumable copy whose checkpoint recorded no states for it cannot replay: say what repeats.
        resumed = all(is_stateful(loader) or getattr(wrapped(loader), "resuming", False) for loader in loaders)
        if trainer.fit_loop.restarted_mid_epoch and resumed:  # Lightning knows only its own resumable loaders
            self.ignore("You're resuming from a checkpoint that ended before the epoch ended and your dataloader")
        elif trainer.fit_loop.restarted_mid_epoch and self._batches_done is not None:
            done, total = self._batches_done, trainer.num_training_batches
            rank_zero_warn(
                f"Resuming in the middle of epoch {trainer.current_epoch} (after {done} of {total} batches): this run "
                "is not an exact continuation. A training loader that cannot be put back at its place reads the data "
                f"from an epoch's start again: in the remaining {total - done} steps of this epoch about {done} "
                "batches' worth of samples are seen twice and as many not at all; later epochs proceed normally. See "
                "docs/reliability.md, Exact at any step."
            )

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning steps plateau schedulers after this hook but not in a resumed epoch, where it assumes the monitored
        # value lost: it is this epoch's validation's, else the checkpoint's (on_train_start).
        if all(monitor in trainer.callback_metrics for monitor in _plateau_monitors(trainer)):
            internals.end_restart(trainer)

    def _train_loaders(self) -> list[DataLoader]:
        loaders: list[DataLoader] = []
        apply_to_collection(self._trainer.train_dataloader, DataLoader, loaders.append)
        return loaders


def _plateau_monitors(trainer: Trainer) -> list[str]:
    return [config.monitor for config in trainer.lr_scheduler_configs if config.reduce_on_plateau]


def _set_epoch(loader: object, epoch: int) -> None:
    """What Lightning does to a loader's samplers at each epoch's start."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def _sampler_generators(loaders: list[DataLoader]) -> list[torch.Generator | None]:
    """The explicit generator of each loader's sampler; None where sampling draws from the global torch RNG (a user's
    batch sampler may have no ``sampler`` inside)."""
    samplers = [getattr(loader.batch_sampler, "sampler", loader.sampler) for loader in loaders]
    generators = [getattr(sampler, "generator", None) for sampler in samplers]
    return [generator if isinstance(generator, torch.Generator) else None for generator in generators]


def _recorded(sampler: Any) -> dict[str, Any] | None:
    """The random states a resumable copy's current epoch was drawn from; None for another loader."""
    if sampler is None or sampler.at_iterator is None or sampler.at_order is None:
        return None
    return {"iterator": sampler.at_iterator, "order": sampler.at_order}


def _on_devices(saved: dict[str, torch.Tensor] | list[torch.Tensor] | None, devices: list[torch.device]) -> dict:
    """The checkpoint's GPU random states matched to the GPUs this process trains on now."""
    gpus = [d for d in devices if d.type == "cuda"]
    if isinstance(saved, list):  # written by an older version: every visible GPU's state, by CUDA's number
        return {d: saved[d.index] for d in gpus if d.index is not None and d.index < len(saved)}
    return dict(zip(gpus, (saved or {}).values(), strict=False))
