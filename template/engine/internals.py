"""The private names of other packages that the engine relies on, each behind one small function tested for real in
``tests/test_internals.py``: a release that changes one fails a test, and at run time raises ``InternalsChanged``
naming the package, its version and the name (the fix: a version from README's "Tested versions")."""

from __future__ import annotations

import atexit
import functools
import importlib
import subprocess
import threading
from collections.abc import Callable
from datetime import timedelta
from importlib.metadata import version
from typing import Any
from unittest import mock

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch import nn


class InternalsChanged(RuntimeError):
    """A private name of another package that the engine relies on is gone or behaves differently."""


def _changed(package: str, name: str, needed_for: str) -> InternalsChanged:
    return InternalsChanged(
        f"{package} {version(package)} no longer has `{name}`, which {needed_for} relies on; install a {package} "
        "version from the tested range in README.md (Tested versions), or adapt engine/internals.py"
    )


def _require(obj: Any, attribute: str, package: str, needed_for: str) -> Any:
    try:
        return getattr(obj, attribute)
    except AttributeError:
        raise _changed(package, f"{type(obj).__name__}.{attribute}", needed_for) from None


def _imported(module: str, name: str, needed_for: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _changed(module.partition(".")[0], f"{module}.{name}", needed_for) from None


# Lightning: process groups, launched ranks, signals and loops (jobs/, resume/, strategy dp).

# The strategies that create a torch.distributed process group with a timeout (DeepSpeed derives from DDP).
PROCESS_GROUP_STRATEGIES: tuple[type[Strategy], ...] = (DDPStrategy, FSDPStrategy, ModelParallelStrategy)


def process_group_timeout(strategy: Strategy) -> timedelta | None:
    """The timeout the strategy gives its process group; None for a strategy without one (one device, dp)."""
    if not isinstance(strategy, PROCESS_GROUP_STRATEGIES):
        return None
    return _require(strategy, "_timeout", "lightning", "joining a restarted torchrun group")


def set_process_group_timeout(timeout: timedelta) -> None:
    """Give the default process group a new timeout for its collectives (torch has no public setter)."""
    c10d = _imported("torch.distributed", "distributed_c10d", "the watchdog's bound on a collective")
    _require(c10d, "_set_pg_timeout", "torch", "the watchdog's bound on a collective")(timeout)


def process_group_backend(strategy: Strategy) -> str | None:
    """The backend (gloo, nccl) the strategy will create its process group with, before it does (the public property
    is set only then); None for a strategy without one."""
    if not isinstance(strategy, PROCESS_GROUP_STRATEGIES):
        return None
    return _require(strategy, "_get_process_group_backend", "lightning", "joining a restarted torchrun group")()


def launched_children(trainer: Trainer) -> list[subprocess.Popen] | None:
    """The child ranks Lightning's script launcher (``strategy: ddp``) started from this process, or None."""
    needed_for = "the hang watchdog (killing hung child ranks)"
    module = "lightning.pytorch.strategies.launchers.subprocess_script"
    launcher = getattr(trainer.strategy, "launcher", None)
    if not isinstance(launcher, _imported(module, "_SubprocessScriptLauncher", needed_for)):
        return None
    return list(_require(launcher, "procs", "lightning", needed_for)) or None


def on_child_failure(handler: Callable[[], None]) -> bool:
    """Have Lightning's launcher call ``handler`` when a child rank exits non-zero, instead of SIGKILLing the job
    without a word of which rank died and how; False when no launcher of this process watches children."""
    needed_for = "the hang watchdog (reporting a dead rank)"
    module = "lightning.fabric.strategies.launchers.subprocess_script"
    observer_class = _imported(module, "_ChildProcessObserver", needed_for)
    observers = [thread for thread in threading.enumerate() if isinstance(thread, observer_class)]
    for observer in observers:
        _require(observer, "_terminate_all", "lightning", needed_for)
        observer._terminate_all = handler
    return bool(observers)


def save_last_where_skipped(callback: Any, trainer: Trainer, at_epoch_end: bool) -> None:
    """Write a ModelCheckpoint's ``last.ckpt`` at this save point where Lightning did not: since 2.6 ``save_last``
    writes it only with a top-k checkpoint, so it falls behind once the monitored score stops improving."""
    needed_for = "last.ckpt at every validation (checkpoints.ModelCheckpoint)"
    names = ("_should_skip_saving_checkpoint", "_should_save_on_train_epoch_end", "_save_last_checkpoint")
    skip, at_train_epoch_end, save_last = (_require(callback, name, "lightning", needed_for) for name in names)
    monitor_candidates = _require(callback, "_monitor_candidates", "lightning", needed_for)
    # skip(trainer): already saved at this step (a top-k checkpoint, and so last.ckpt).
    if callback.save_last is True and not skip(trainer) and at_train_epoch_end(trainer) == at_epoch_end:
        save_last(trainer, monitor_candidates(trainer))


def cluster_environment(trainer: Trainer) -> Any:
    """The cluster environment (SLURM, torchrun, ...) the Trainer detected, also under a single-device strategy."""
    connector = _require(trainer, "_accelerator_connector", "lightning", "preemption (SLURM requeue signal)")
    return _require(connector, "cluster_environment", "lightning", "preemption (SLURM requeue signal)")


def stop_as_on_sigterm(trainer: Trainer, stop: bool = True) -> None:
    """End the run as Lightning does on SIGTERM: after this step, raising ``SIGTERMException`` (the job's exit code),
    where ``trainer.should_stop`` would end it quietly and still validate. ``stop=False``: Lightning's own SIGTERM,
    which would end the run after the next step without a checkpoint, is forgotten (the caller took it over)."""
    connector = _require(trainer, "_signal_connector", "lightning", "preemption (stopping on a signal)")
    _require(connector, "received_sigterm", "lightning", "preemption (stopping on a signal)")
    connector.received_sigterm = stop


def accumulating(trainer: Trainer) -> bool:
    """Whether the training batch that just ended only accumulated gradients, which a checkpoint would lose."""
    loop = trainer.fit_loop.epoch_loop
    return bool(_require(loop, "_should_accumulate", "lightning", "exact resume (gradient accumulation)")())


def validation_follows(trainer: Trainer) -> bool:
    """Whether Lightning validates right after the training batch that just ended: resumed from a checkpoint written
    there, it would skip that validation (and change the metrics, best checkpoints and random states after it)."""
    loop = trainer.fit_loop.epoch_loop
    should_check = _require(loop, "_should_check_val_fx", "lightning", "exact resume (validation during an epoch)")
    return bool(should_check(fit_data_fetcher(trainer)))


def end_restart(trainer: Trainer) -> None:
    """Count the resumed epoch as run: at its end Lightning steps ``ReduceLROnPlateau`` only when the fit loop is not
    restarting, which it stays for the whole resumed epoch (its public setter keeps it under ``max_steps``)."""
    _require(trainer.fit_loop, "_restarting", "lightning", "exact resume (ReduceLROnPlateau)")
    trainer.fit_loop._restarting = False


def call_epoch_start_hooks(trainer: Trainer) -> None:
    """Run ``on_train_epoch_start`` of every callback and then of the module, as Lightning's fit loop does at an
    epoch's start (it skips them for an epoch resumed in its middle), with the loggers away: what they logged there the
    epoch's start has logged already."""
    call = _imported("lightning.pytorch.trainer", "call", "exact resume (re-entering an epoch)")
    loggers, trainer.loggers = trainer.loggers, []
    try:
        _require(call, "_call_callback_hooks", "lightning", "exact resume (re-entering an epoch)")(
            trainer, "on_train_epoch_start"
        )
        call._call_lightning_module_hook(trainer, "on_train_epoch_start")
    finally:
        trainer.loggers = loggers


def _epoch_results(trainer: Trainer) -> Any:
    return _require(trainer.fit_loop.epoch_loop, "_results", "lightning", "exact resume (epoch means)")


def epoch_sums(trainer: Trainer) -> dict[str, list[torch.Tensor]]:
    """What each tensor logged with ``on_epoch=True`` has accumulated in this training epoch so far: its running value
    (for a mean, the sum weighted by batch size) and, for a mean, the batch sizes' sum."""
    return {
        key: [result.value.detach().cpu().clone(), getattr(result, "cumulated_batch_size", torch.tensor(0)).cpu()]
        for key, result in _epoch_results(trainer).items()
        if result.is_tensor and result.meta.on_epoch
    }


def add_epoch_sums(trainer: Trainer, sums: dict[str, list[torch.Tensor]]) -> None:
    """Fold ``epoch_sums`` of an interrupted epoch into what the same values have accumulated since; the keys folded
    in are taken out of ``sums`` (a value not logged again yet waits for a later step)."""
    results = _epoch_results(trainer)
    for key in [key for key in sums if key in results]:
        result, (value, count) = results[key], sums.pop(key)
        value = value.to(result.value.device)
        if result.meta.is_mean_reduction:
            result.value = result.value + value
            result.cumulated_batch_size = result.cumulated_batch_size + count.to(result.value.device)
        elif result.meta.is_sum_reduction:
            result.value = result.value + value
        else:  # max or min
            result.value = result.meta.reduce_fx(result.value, value)


def combined_loader_mode(trainer: Trainer) -> str:
    """How Lightning's CombinedLoader walks several training loaders (``max_size_cycle`` unless the user chose)."""
    combined = _require(trainer.fit_loop, "_combined_loader", "lightning", "exact resume (several training loaders)")
    return "max_size_cycle" if combined is None else _require(combined, "_mode", "lightning", "several loaders")


def layer_sync_enabled(strategy: Strategy) -> bool:
    """Whether ``sync_batchnorm`` was asked for (the Trainer handed the strategy a ``_layer_sync``)."""
    return _require(strategy, "_layer_sync", "lightning", "strategy dp's sync_batchnorm check") is not None


STEP_HOOKS = tuple(
    f"on_{stage}_batch_{edge}" for stage in ("train", "validation", "test", "predict") for edge in ("start", "end")
) + ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


def skip_idle_step_hooks(callback: Callback) -> None:
    """Set to None, on the instance, the per-batch hooks ``callback``'s class leaves as ``Callback``'s no-ops: on every
    batch Lightning's ``_call_callback_hooks`` enters a profiler context for each hook that is callable. Only for the
    engine's callbacks, never the user's."""
    for name in STEP_HOOKS:
        if getattr(type(callback), name) is getattr(Callback, name):
            setattr(callback, name, None)


def fit_data_fetcher(trainer: Trainer) -> Any:
    """The fit loop's data fetcher, whose iterator exact resume builds again after restoring a sampler's generator."""
    return _require(trainer.fit_loop, "_data_fetcher", "lightning", "exact resume (sampler generators)")


def built_by_lightning_cli() -> bool:
    """Whether LightningCLI builds the LightningModule being constructed now (it then hands ``save_hyperparameters``
    the ``class_path`` configuration, which a ``weights_only`` checkpoint can hold) or it is built by hand."""
    module = "lightning.pytorch.core.mixins.hparams_mixin"
    return _imported(module, "_given_hyperparameters", "saving hyper-parameters").get() is not None


# Lightning and jsonargparse: the command line (commands/cli.py).


def print_config_action() -> Any:
    """jsonargparse's ``--print_config`` action: ``skip_print_config()`` defers the print, which
    ``print_config_if_requested(parser, config)`` then does with the configuration the run will use."""
    action = _imported("jsonargparse._actions", "_ActionPrintConfig", "--print_config")
    for name in ("skip_print_config", "print_config_if_requested"):
        _require(action, name, "jsonargparse", "--print_config")
    return action


def instantiator_class() -> type:
    """LightningCLI's model instantiator, which records the config as hyper-parameters."""
    return _imported("lightning.pytorch.cli", "_InstantiatorFn", "the model's hyper-parameters")


# torch: in-place compilation (compile, strategy dp), learning-rate schedulers (scaling), the resumable DataLoader.


def is_compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` has run on it (no public query; compiling twice would wrap the call again)."""
    return _require(module, "_compiled_call_impl", "torch", "torch.compile of the network") is not None


def set_compiled_call(module: nn.Module, call: Callable[..., Any]) -> None:
    """Make ``module(...)`` run ``call`` instead of its eager forward, as ``module.compile()`` does."""
    _require(module, "_compiled_call_impl", "torch", "torch.compile under strategy dp")
    module._compiled_call_impl = call


def eager_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call ``module`` with its hooks but without its compiled call: what a compiled call wraps."""
    return _require(module, "_call_impl", "torch", "torch.compile under strategy dp")(*args, **kwargs)


def child_schedulers(scheduler: Any) -> list[Any]:
    """The schedulers that ``SequentialLR`` and ``ChainedScheduler`` hold; [] for others."""
    if isinstance(scheduler, (torch.optim.lr_scheduler.SequentialLR, torch.optim.lr_scheduler.ChainedScheduler)):
        return list(_require(scheduler, "_schedulers", "torch", "learning-rate scaling"))
    return []


def last_lr_attributes(scheduler: Any) -> tuple[str, ...]:
    """The attribute where a torch scheduler keeps what ``get_last_lr()`` returns; none for other objects."""
    if not isinstance(scheduler, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return ()
    _require(scheduler, "_last_lr", "torch", "learning-rate scaling")
    return ("_last_lr",)


def has_iterator(loader: Any) -> bool:
    """Whether a DataLoader has made its iterator, which persistent workers keep and reset each epoch."""
    return _require(loader, "_iterator", "torch", "exact resume (persistent workers)") is not None


def dataloader_copy(loader: Any, cls: type) -> Any:
    """A shallow copy of ``loader`` as an instance of ``cls`` (a subclass of its class), without the original's
    iterator and so without its persistent workers."""
    _require(loader, "_iterator", "torch", "exact resume (the training loader's copy)")
    copy = cls.__new__(cls)
    copy.__dict__.update(vars(loader), _iterator=None)
    return copy


# Lightning: loggers (files left as they were when a save fails).


def built_experiment(logger: Any) -> Any:
    """The logger's experiment (CSV writer, SummaryWriter) if it exists, else None: ``logger.experiment`` would create
    it, and its folder."""
    return _require(logger, "_experiment", "lightning", "leaving metrics.csv intact when a save fails")


def lr_finder_without_bar() -> Any:
    """A patch (a context manager) that keeps Lightning's learning-rate finder from drawing its bar, which it draws
    whatever the Trainer's ``enable_progress_bar``."""
    tqdm = _imported("lightning.pytorch.tuner.lr_finder", "tqdm", "tune lr without a progress bar")
    return mock.patch("lightning.pytorch.tuner.lr_finder.tqdm", functools.partial(tqdm, disable=True))


# Lightning and torch: strategy fsdp, which replaces ModelParallelStrategy.setup and keeps its steps.

# The file of a sharded checkpoint folder that holds all but the shards; ModelParallelStrategy reads it by this name.
SHARDED_METADATA: str = _imported("lightning.fabric.utilities.load", "_METADATA_FILENAME", "sharded checkpoints")


def materialize_meta_module(module: nn.Module, device: torch.device) -> None:
    """Allocate on ``device`` the parameters a module created on the meta device."""
    _imported("lightning.fabric.utilities.init", "_materialize_distributed_module", "strategy fsdp")(module, device)


def optimizers_to_device(optimizers: list[Any], device: torch.device) -> None:
    """Move optimizer states to ``device``."""
    _imported("lightning.fabric.utilities.optimizer", "_optimizers_to_device", "strategy fsdp")(optimizers, device)


def checkpoint_wrapper(module: nn.Module) -> nn.Module:
    """``module`` with its activations recomputed in the backward pass, its state_dict keys unchanged."""
    module_name = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
    return _imported(module_name, "checkpoint_wrapper", "fsdp checkpoint_layers")(module)


def set_data_parallel_size(strategy: ModelParallelStrategy, size: int) -> None:
    """Make the strategy's device mesh ``size`` data-parallel shards: its constructor takes the size before the Trainer
    has given it devices, and its ``"auto"`` means one shard per node."""
    _require(strategy, "_data_parallel_size", "lightning", "strategy fsdp (one shard per process)")
    strategy._data_parallel_size = size


# Optuna: the sweep's sampler.


def queued_values(trial: Any) -> dict[str, Any]:
    """The values ``study.enqueue_trial`` gave a trial (a FrozenTrial), which Optuna keeps in a system attribute."""
    return trial.system_attrs.get("fixed_params", {})


# Python: a process that multiprocessing started (sweep/driver.py).


def run_exit_handlers() -> None:
    """Run the ``atexit`` handlers now, as the interpreter does at its exit: a multiprocessing child ends with
    ``os._exit``, which skips them (loggers' and data loaders' clean-up, a tracker ending its run)."""
    atexit._run_exitfuncs()
