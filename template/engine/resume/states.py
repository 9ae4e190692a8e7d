"""Exact resume: every process's random states travel in the checkpoint and come back on resume, a fit restarted in
the middle of an epoch re-enters it as Lightning entered it, and a checkpoint written on the way (a stop, a periodic
save) is written only where Lightning resumes exactly."""

from __future__ import annotations

import copy
import hashlib
import math
import pickle
import warnings
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from lightning.fabric.utilities.data import has_len
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader
from torchmetrics import Metric

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


class Restart(Enum):
    """Where the checkpoint a fit starts from was written, as Lightning's fit loop tells it."""

    FRESH = "no checkpoint, or one before an epoch's start"
    MID_EPOCH = "inside an epoch: its order replayed from the batch after, its start re-entered"
    EPOCH_END = "at an epoch's end: the next epoch's order drawn from the checkpoint's random states"

    @classmethod
    def of(cls, trainer: Trainer) -> Restart:
        loop = trainer.fit_loop
        if loop.restarted_mid_epoch:
            return cls.MID_EPOCH
        if loop.restarted_on_epoch_end or loop.resumed_on_epoch_end:
            return cls.EPOCH_END
        return cls.FRESH


@runtime_checkable
class Stopper(Protocol):
    """A callback that stops the run on a signal (``jobs.Preemption``, a layer above): whether a stop is under way,
    so that a checkpoint written for it says at once where the continuation cannot be exact."""

    @property
    def stopping(self) -> bool: ...


class ExactResume(Callback):
    """The exact-resume callback. Saves torch, CUDA, Python, NumPy and sampler-generator states per rank (tensors
    and plain values: loaded weights-only) and restores them; puts a map-style training DataLoader (each of several)
    back at its place in an epoch; re-enters an epoch resumed in its middle as Lightning entered it (the epoch-start
    hooks of every callback and the module run again from the states they ran from) with its epoch means' running
    sums and the module's torchmetrics states; steps ``ReduceLROnPlateau`` schedulers where the uninterrupted run steps
    them (the values they monitor travel)."""

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
        self._epoch_start: dict[str, Any] = {}  # what this epoch's start hooks ran from
        self._pending_sums: dict[str, list[torch.Tensor]] = {}  # the interrupted epoch's, until logged again
        self._wrapped: Any = None
        self._ignored: list[Any] = []  # warnings filters this fit added, removed at its end

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage != "fit" or self._wrapped is not None:
            return
        # First at an epoch's start: the states the other callbacks' and the module's hooks start from are recorded.
        trainer.callbacks.remove(self)
        trainer.callbacks.insert(0, self)
        # The training loader becomes its resumable copy after Lightning inserted its samplers and before it makes
        # the first iterator, and the restart continues after every on_train_start: no callback hook runs there, the
        # strategy's do (on the instance, undone at teardown).
        strategy = trainer.strategy
        process, train_start = strategy.process_dataloader, strategy.on_train_start
        save, load = strategy.save_checkpoint, strategy.load_checkpoint

        def process_dataloader(dataloader: object) -> object:
            dataloader = process(dataloader)
            if trainer.state.stage != RunningStage.TRAINING:
                return dataloader
            # Lightning sets the samplers' epoch after the first iterator: a DistributedSampler drew epoch 0's.
            _set_epoch(dataloader, trainer.fit_loop.epoch_progress.current.processed)
            return self._resumable(dataloader)

        def on_train_start() -> None:
            train_start()
            self._continue(trainer, trainer.lightning_module)

        def save_checkpoint(checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> None:
            save(_keep_per_rank(checkpoint), *args, **kwargs)

        def load_checkpoint(*args: Any, **kwargs: Any) -> dict[str, Any]:
            return _own_rank(load(*args, **kwargs), trainer.global_rank)

        vars(strategy).update(
            process_dataloader=process_dataloader, on_train_start=on_train_start, save_checkpoint=save_checkpoint,
            load_checkpoint=load_checkpoint,
        )  # fmt: skip
        self._wrapped = strategy

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._wrapped is not None:
            for name in ("process_dataloader", "on_train_start", "save_checkpoint", "load_checkpoint"):
                vars(self._wrapped).pop(name, None)  # the class's methods are back
            self._wrapped = None
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
        if sampler is None or pending is None:
            return resumable
        # Each loader at its own place: a shorter one of several may have started again within the epoch.
        done = pending.get("done", self._batches_done)
        if self._batches_done and not self._last_batch:
            # Restarted in the middle of an epoch: its order again, without the batches already trained on.
            sampler.resume(pending["iterator"], pending["order"], done)
        else:
            sampler.keep_workers_seed(pending["iterator"], pending["order"])
        return resumable

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Before every other epoch-start hook (this callback is the first): what they start from.
        self._epoch_start = {
            "states": global_states(),
            "callbacks": {c.state_key: copy.deepcopy(c.state_dict()) for c in _epoch_start_callbacks(trainer, self)},
            "optimizers": [[_hyperparameters(group) for group in o.param_groups] for o in trainer.optimizers],
        }

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        progress = trainer.fit_loop.epoch_loop.batch_progress
        done = progress.current.processed
        # A stop under way: Lightning's own SIGTERM handling, or a Stopper's (jobs.Preemption).
        stopping = trainer.received_sigterm or any(isinstance(c, Stopper) and c.stopping for c in trainer.callbacks)
        if not stopping or not done or progress.is_last_batch:
            return
        # Said now, not after the restart, where the continuation will differ.
        for index, loader in enumerate(self._train_loaders()):
            reason = _not_exact_reason(loader)
            if reason is not None:
                name = f"{type(loader).__name__} over {type(getattr(loader, 'dataset', None)).__name__}"
                rank_zero_info(
                    f"Not exact: training loader {index} ({name}) cannot be put back at batch {done} of epoch "
                    f"{trainer.current_epoch}: {reason}; {_what_repeats(done, trainer.num_training_batches)}."
                    " See docs/reliability.md, Exact at any step."
                )

    def state_dict(self) -> dict[str, Any]:
        """Called on every rank while a checkpoint is assembled; rank 0's copy (holding all ranks) is written."""
        trainer = self._trainer
        loaders = self._train_loaders()
        state = global_states()
        # By the devices this process trains on, in order: a continuation puts them on its own, however numbered.
        devices = process_devices(trainer.strategy)
        state["cuda"] = {str(d): torch.cuda.get_rng_state(d) for d in devices if d.type == "cuda"}
        state["samplers"] = [g.get_state() if g is not None else None for g in _sampler_generators(loaders)]
        places = _places(trainer, loaders)
        state["loaders"] = [_recorded(wrapped(loader), place) for loader, place in zip(loaders, places, strict=True)]
        metrics = trainer.callback_metrics  # what a plateau scheduler steps on at the epoch's end
        state["monitors"] = {k: metrics[k].cpu() for k in _plateau_monitors(trainer) if k in metrics}
        state.update(self._epoch_state(trainer))
        ranks: list[Any] = [state]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, state)
        return {"world_size": len(ranks), "ranks": ranks}

    def _epoch_state(self, trainer: Trainer) -> dict[str, Any]:
        """The parameters frozen now and, inside an epoch, what its end will report on and where its start hooks
        began."""
        module = trainer.lightning_module
        state: dict[str, Any] = {"frozen": [name for name, p in module.named_parameters() if not p.requires_grad]}
        progress = trainer.fit_loop.epoch_loop.batch_progress
        if trainer.state.fn == TrainerFn.FITTING and progress.current.processed and not progress.is_last_batch:
            internals.add_epoch_sums(trainer, self._pending_sums)  # a second stop in a resumed epoch: all of it
            state["epoch_sums"] = {**self._pending_sums, **internals.epoch_sums(trainer)}
            state["metrics"] = {n: _cpu(m.metric_state) for n, m in module.named_modules() if isinstance(m, Metric)}
            state["epoch_start"] = self._epoch_start
        return state

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

    def _continue(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """After every ``on_train_start``, before the first batch: the restored run continues where it stopped."""
        restored, self._restored = self._restored, None
        restart = Restart.of(trainer)
        if restored is not None:
            trainer.callback_metrics.update(restored.get("monitors", {}))
            frozen = set(restored.get("frozen", ()))
            for name, parameter in pl_module.named_parameters():
                parameter.requires_grad_(name not in frozen)  # a callback's freezing of earlier epochs included
        if trainer.fit_loop.resumed_on_epoch_end and pl_module.automatic_optimization:
            _step_plateau_schedulers(trainer, pl_module)
        if restart is Restart.MID_EPOCH and restored is not None and "epoch_start" in restored:
            self._reenter_epoch(trainer, pl_module, restored)
        loaders = self._train_loaders()
        if restart is Restart.EPOCH_END:
            # Lightning built the next epoch's iterator before setting the samplers' epoch: it is built again.
            for loader in loaders:
                _set_epoch(loader, trainer.fit_loop.epoch_progress.current.processed)
        if restored is not None:
            self._restore_order(trainer, loaders, restored, restart)
        self._say_what_repeats(trainer, loaders, restart)

    def _reenter_epoch(self, trainer: Trainer, pl_module: LightningModule, restored: dict[str, Any]) -> None:
        """Run the resumed epoch's start hooks (Lightning skips them) from the callbacks' states, the optimizers'
        hyper-parameters and the random states they ran from; what the epoch changed since comes back after them."""
        start = restored["epoch_start"]
        now = global_states()
        trained = [[_hyperparameters(group) for group in o.param_groups] for o in trainer.optimizers]
        restore_global_states(start["states"])
        for callback in _epoch_start_callbacks(trainer, self):
            if callback.state_key in start["callbacks"]:
                callback.load_state_dict(copy.deepcopy(start["callbacks"][callback.state_key]))
        for optimizer, groups in zip(trainer.optimizers, start["optimizers"], strict=False):
            del optimizer.param_groups[len(groups) :]  # those an epoch-start hook adds (a backbone unfrozen)
            for group, hyperparameters in zip(optimizer.param_groups, groups, strict=True):
                group.update(hyperparameters)
        internals.call_epoch_start_hooks(trainer)
        for optimizer, groups in zip(trainer.optimizers, trained, strict=False):
            for group, hyperparameters in zip(optimizer.param_groups, groups, strict=False):
                group.update(hyperparameters)  # the rates the epoch's steps reached
        self._epoch_start = start
        restore_global_states(now)
        self._pending_sums = dict(restored.get("epoch_sums", {}))
        for name, states in restored.get("metrics", {}).items():
            metric = pl_module.get_submodule(name)
            for attribute, value in states.items():
                setattr(metric, attribute, _to(value, metric.device))

    def _restore_order(
        self, trainer: Trainer, loaders: list[DataLoader], restored: dict[str, Any], restart: Restart
    ) -> None:
        stateful, replayed = _put_back_by_loaders(loaders)
        # Stopped at an epoch's last batch, the iterator Lightning built for what is left of it reads nothing.
        exhausted = restart is Restart.MID_EPOCH and self._last_batch
        if stateful or replayed or exhausted or restart is Restart.EPOCH_END:
            # Making the restored (at an epoch's end: the next) iterator drew from the global generators, which the
            # uninterrupted run did earlier or not at all, from the checkpoint's states.
            restore_global_states(restored)
        # A place in the epoch put back brings its sampler generator with it.
        put_back = (stateful and restart is Restart.MID_EPOCH) or replayed
        restored_generators = _set_sampler_states(loaders, [] if put_back else restored["samplers"])
        if (restored_generators or restart is Restart.EPOCH_END) and not exhausted:
            # Lightning built the epoch's iterator before this hook: a new one draws from the restored states.
            iter(internals.fit_data_fetcher(trainer))

    def _say_what_repeats(self, trainer: Trainer, loaders: list[DataLoader], restart: Restart) -> None:
        if restart is not Restart.MID_EPOCH or self._batches_done is None or self._last_batch:
            return
        # Lightning's own warning knows only its own resumable loaders, and names an infinite epoch's steps "inf".
        self.ignore("You're resuming from a checkpoint that ended before the epoch ended and your dataloader")
        done, total = self._batches_done, trainer.num_training_batches
        for index, loader in enumerate(loaders):
            if not (is_stateful(loader) or getattr(wrapped(loader), "resuming", False)):
                rank_zero_info(
                    f"Resuming in the middle of epoch {trainer.current_epoch} after {done} batches: training loader "
                    f"{index} cannot be put back at its place, so this run is not an exact continuation; "
                    f"{_what_repeats(done, total)}. See docs/reliability.md, Exact at any step."
                )

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        # In the resumed epoch: the sums from before the stop added to each value logged for the first time since
        # (0 + a + S is S + a, bit for bit: the uninterrupted run's order of additions), until none is left.
        if self._pending_sums:
            internals.add_epoch_sums(trainer, self._pending_sums)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pending_sums = {}  # a value the resumed epoch never logged again ends with the epoch
        # Lightning steps plateau schedulers after this hook but not in a resumed epoch, where it assumes the monitored
        # value lost: it is this epoch's validation's, else the checkpoint's (on_train_start).
        if all(monitor in trainer.callback_metrics for monitor in _plateau_monitors(trainer)):
            internals.end_restart(trainer)

    def _train_loaders(self) -> list[DataLoader]:
        loaders: list[DataLoader] = []
        apply_to_collection(self._trainer.train_dataloader, DataLoader, loaders.append)
        return loaders


# What every rank holds alike, or holds its own shard of (a sharded strategy's weights), is not compared.
_NOT_PER_RANK = ("state_dict", "optimizer_states", "loops", "callbacks")


def _keep_per_rank(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint with what differs between ranks (a module's, a DataModule's or a callback's own, added in
    ``on_save_checkpoint``) kept for every rank under ``per_rank``: rank 0's stays in place, each rank gets its own
    back at load (``_own_rank``). Called on every rank: two all-gathers where values differ, one where none do."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return checkpoint
    own = _own_values(checkpoint)
    digests = {name: hashlib.sha1(pickle.dumps(_cpu(value))).hexdigest() for name, value in own.items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, digests)
    differing = [name for name in own if any(d.get(name) != digests[name] for d in every)]
    if not differing:
        return checkpoint
    dist.all_gather_object(every, [_cpu(own[name]) for name in differing])
    ranks = [[section, key, [values[i] for values in every]] for i, (section, key) in enumerate(differing)]
    return {**checkpoint, "per_rank": ranks}


def _own_values(checkpoint: dict[str, Any]) -> dict[tuple[str, str], Any]:
    own = {("", k): v for k, v in checkpoint.items() if k not in _NOT_PER_RANK}
    callbacks = checkpoint.get("callbacks", {})
    own.update({("callbacks", k): v for k, v in callbacks.items() if k != ExactResume.__name__})
    return own


def _own_rank(checkpoint: dict[str, Any], rank: int) -> dict[str, Any]:
    """A loaded checkpoint with this rank's own values where ``_keep_per_rank`` kept each rank's."""
    for section, key, values in checkpoint.pop("per_rank", []):
        if rank < len(values):
            (checkpoint[section] if section else checkpoint)[key] = values[rank]
    return checkpoint


def _plateau_monitors(trainer: Trainer) -> list[str]:
    return [config.monitor for config in trainer.lr_scheduler_configs if config.reduce_on_plateau]


def _epoch_start_callbacks(trainer: Trainer, own: Callback) -> list[Callback]:
    """The callbacks with an epoch-start hook of their own, whose state it may change."""
    hooked = [c for c in trainer.callbacks if type(c).on_train_epoch_start is not Callback.on_train_epoch_start]
    return [c for c in hooked if c is not own]


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}


def _cpu(states: dict[str, Any]) -> dict[str, Any]:
    return apply_to_collection(states, torch.Tensor, lambda t: t.detach().cpu().clone())


def _to(value: Any, device: torch.device) -> Any:
    return apply_to_collection(value, torch.Tensor, lambda t: t.to(device))


def _step_plateau_schedulers(trainer: Trainer, pl_module: LightningModule) -> None:
    """Written in an epoch's on_train_epoch_end, before Lightning stepped plateau schedulers there: the resumed run
    starts after that epoch's end, so they step now, as Lightning would have."""
    for config in trainer.lr_scheduler_configs:
        due = config.interval == "epoch" and trainer.current_epoch % config.frequency == 0
        if config.reduce_on_plateau and due and config.monitor in trainer.callback_metrics:
            pl_module.lr_scheduler_step(config.scheduler, trainer.callback_metrics[config.monitor])


def _not_exact_reason(loader: DataLoader) -> str | None:
    reason = not_resumable_reason(loader)
    sampler = wrapped(loader)
    if reason is None and sampler is not None and not sampler.order_reproducible():
        reason = (
            f"its sampler {type(sampler.inner).__name__} draws an order the recorded random states do not draw again"
        )
    return reason


def _what_repeats(done: int, total: float) -> str:
    """What the restart of a loader that cannot be put back at batch ``done`` of an epoch of ``total`` batches trains
    on, in one clause."""
    if math.isinf(total):  # the epoch ends where the data does: it is read whole again
        return (
            f"the restart reads the epoch's data again from its start: the first {done} batches are trained on "
            f"twice ({done} steps more)"
        )
    return (
        f"the restart reads the epoch's data again from its start for its remaining {int(total) - done} batches: "
        f"about {min(done, int(total) - done)} batches are trained on twice, as many not at all"
    )


def _places(trainer: Trainer, loaders: list[DataLoader]) -> list[int]:
    """Each training loader's place in the epoch after the batches trained on: several loaders walked by Lightning's
    CombinedLoader each have their own (a shorter one starts again in ``max_size_cycle``, stays at its end in
    ``max_size``)."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    mode = internals.combined_loader_mode(trainer) if len(loaders) > 1 else "min_size"
    places = []
    for loader in loaders:
        length = len(loader) if has_len(loader) else done
        if done and mode == "max_size_cycle":
            places.append((done - 1) % length + 1)
        else:
            places.append(min(done, length) if mode == "max_size" else done)
    return places


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


def _put_back_by_loaders(loaders: list[DataLoader]) -> tuple[bool, bool]:
    """Whether every loader is a StatefulDataLoader, whose place and sampler generator Lightning restores (a new
    iterator would lose them); whether a resumable copy replays its epoch (leaving the global generators where its
    workers' seed was drawn)."""
    stateful = bool(loaders) and all(is_stateful(loader) for loader in loaders)
    replayed = any((sampler := wrapped(loader)) is not None and sampler.resuming for loader in loaders)
    return stateful, replayed


def _set_sampler_states(loaders: list[DataLoader], states: list[Any]) -> bool:
    """Each loader's sampler generator back at its saved state; whether any was."""
    restored = False
    for generator, saved in zip(_sampler_generators(loaders), states, strict=False):
        if generator is not None and saved is not None:
            generator.set_state(saved)
            restored = True
    return restored


def _recorded(sampler: Any, place: int) -> dict[str, Any] | None:
    """The random states a resumable copy's current epoch was drawn from, and its place; None for another loader."""
    if sampler is None or sampler.at_iterator is None or sampler.at_order is None:
        return None
    return {"iterator": sampler.at_iterator, "order": sampler.at_order, "done": place}


def _on_devices(saved: dict[str, torch.Tensor] | list[torch.Tensor] | None, devices: list[torch.device]) -> dict:
    """The checkpoint's GPU random states matched to the GPUs this process trains on now."""
    gpus = [d for d in devices if d.type == "cuda"]
    if isinstance(saved, list):  # written by an older version: every visible GPU's state, by CUDA's number
        return {d: saved[d.index] for d in gpus if d.index is not None and d.index < len(saved)}
    return dict(zip(gpus, (saved or {}).values(), strict=False))
