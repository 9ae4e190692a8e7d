"""The private names of other packages that the engine relies on, each behind one small function, in one place.

Lightning, jsonargparse and torch keep no promise about names that start with an underscore. Every such access of
the engine goes through this module, and ``tests/test_internals.py`` exercises each one for real, so that a release
that renames or changes one fails a test instead of silently switching a guarantee off (no hang watchdog, an
inexact resume). At run time a missing name raises ``InternalsChanged`` naming the package, its installed version
and the name: the fix is to install a version in the tested range (README, "Tested versions").
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch import nn


class InternalsChanged(RuntimeError):
    """A private name of another package that the engine relies on is gone or behaves differently."""


def _changed(package: str, name: str, needed_for: str) -> InternalsChanged:
    try:
        installed = version(package)
    except PackageNotFoundError:
        installed = "(version unknown)"
    return InternalsChanged(
        f"{package} {installed} no longer has `{name}`, which {needed_for} relies on; install a {package} version "
        "from the tested range in README.md (Tested versions), or adapt engine/internals.py"
    )


def _require(obj: Any, attribute: str, package: str, needed_for: str) -> Any:
    try:
        return getattr(obj, attribute)
    except AttributeError:
        raise _changed(package, f"{type(obj).__name__}.{attribute}", needed_for) from None


# ---------------------------------------------------------------------------------------------------------------------
# Lightning: process groups (the watchdog's timeout, torchrun restarts)

# The strategies that create a torch.distributed process group with a timeout (DeepSpeed derives from DDP).
PROCESS_GROUP_STRATEGIES: tuple[type[Strategy], ...] = (DDPStrategy, FSDPStrategy, ModelParallelStrategy)


def process_group_timeout(strategy: Strategy) -> timedelta | None:
    """The timeout the strategy will give its process group; None for a strategy without one (one device, dp).

    After a torchrun restart the engine creates the process group itself, with the timeout Lightning would give it
    (the watchdog's, or one the user set); Lightning keeps it in ``strategy._timeout`` and passes it to
    ``init_process_group`` in ``setup_distributed``.
    """
    if not isinstance(strategy, PROCESS_GROUP_STRATEGIES):
        return None
    return _require(strategy, "_timeout", "lightning", "joining a restarted torchrun group")


def process_group_backend(strategy: Strategy) -> str | None:
    """The backend (gloo, nccl) the strategy will create its process group with; None for one without a group.

    After a torchrun restart the engine creates the process group itself (under a fresh store prefix) before
    Lightning does, and must use the backend Lightning would have chosen: ``_get_process_group_backend()`` applies
    the user's ``process_group_backend`` or the device's default. The public ``process_group_backend`` property is
    only set once Lightning has created the group.
    """
    if not isinstance(strategy, PROCESS_GROUP_STRATEGIES):
        return None
    backend = _require(strategy, "_get_process_group_backend", "lightning", "joining a restarted torchrun group")
    return backend()


def launched_children(trainer: Trainer) -> list[subprocess.Popen] | None:
    """The child ranks this process started with Lightning's script launcher (``strategy: ddp``), or None.

    The hang watchdog kills them when this process fails, or a hung rank outlives the job. Lightning's launcher
    (``_SubprocessScriptLauncher``) keeps them in ``procs``; it is the launcher of ``ddp`` on CPU and on GPUs.
    """
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    if not isinstance(launcher, _SubprocessScriptLauncher):
        return None
    procs = _require(launcher, "procs", "lightning", "the hang watchdog (killing hung child ranks)")
    return list(procs) or None


def on_child_failure(handler: Callable[[], None]) -> bool:
    """Have Lightning's launcher call ``handler`` (in its watching thread) when a child rank exits non-zero, instead of
    SIGKILLing this process and the other children; False when no launcher of this process watches any.

    ``_SubprocessScriptLauncher`` starts a ``_ChildProcessObserver`` thread that polls the children every 5 s and, on
    a non-zero exit, SIGKILLs the job, this process included: a rank killed by the OOM killer would end the job with
    no word of which rank and how. The hang watchdog reports it instead, and takes the job down itself.
    """
    import threading

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    observers = [thread for thread in threading.enumerate() if isinstance(thread, _ChildProcessObserver)]
    for observer in observers:
        _require(observer, "_terminate_all", "lightning", "the hang watchdog (reporting a dead rank)")
        observer._terminate_all = handler
    return bool(observers)


def save_last_where_skipped(callback: Any, trainer: Trainer, at_epoch_end: bool) -> None:
    """Write a ModelCheckpoint's ``last.ckpt`` at this save point (a validation's end, or the training epoch's end
    when it saves there) where Lightning wrote nothing: since 2.6 ``save_last=True`` writes it only at a step where a
    top-k checkpoint was saved, so once the monitored score stops improving ``last.ckpt`` stays behind."""
    needed_for = "last.ckpt at every validation (checkpoints.ModelCheckpoint)"
    names = ("_should_skip_saving_checkpoint", "_should_save_on_train_epoch_end", "_save_last_checkpoint")
    skip, at_train_epoch_end, save_last = (_require(callback, name, "lightning", needed_for) for name in names)
    monitor_candidates = _require(callback, "_monitor_candidates", "lightning", needed_for)
    # Already saved at this step (a top-k checkpoint, and so last.ckpt): skip(trainer) says so.
    if callback.save_last is True and not skip(trainer) and at_train_epoch_end(trainer) == at_epoch_end:
        save_last(trainer, monitor_candidates(trainer))


def cluster_environment(trainer: Trainer) -> Any:
    """The cluster environment (SLURM, torchrun, ...) the Trainer detected, also under a single-device strategy.

    Preemption reads SLURM's requeue signal and ``auto_requeue`` from it. Only parallel strategies expose it
    publicly (``strategy.cluster_environment``); Lightning's own signal handling reads the accelerator connector's.
    """
    connector = _require(trainer, "_accelerator_connector", "lightning", "preemption (SLURM requeue signal)")
    return _require(connector, "cluster_environment", "lightning", "preemption (SLURM requeue signal)")


def stop_as_on_sigterm(trainer: Trainer) -> None:
    """Make Lightning end the run as it does on SIGTERM: after this step, raising ``SIGTERMException``.

    ``trainer.should_stop`` would end the run quietly (exit 0, validation still run); preemption needs the SIGTERM
    path, which ends the loop at once and raises the exception that gives the job its exit code. Lightning's own
    handler sets ``trainer._signal_connector.received_sigterm``, which ``trainer.received_sigterm`` reads.
    """
    connector = _require(trainer, "_signal_connector", "lightning", "preemption (stopping on a signal)")
    _require(connector, "received_sigterm", "lightning", "preemption (stopping on a signal)")
    connector.received_sigterm = True


def accumulating(trainer: Trainer) -> bool:
    """Whether the training batch that just ended only accumulated gradients: the optimizer steps at a later batch.

    Checkpoints hold no gradients, so one written between micro-batches (``accumulate_grad_batches`` > 1) would lose
    those accumulated so far. Lightning decides it in ``fit_loop.epoch_loop._should_accumulate()``.
    """
    loop = trainer.fit_loop.epoch_loop
    return bool(_require(loop, "_should_accumulate", "lightning", "exact resume (gradient accumulation)")())


def validation_follows(trainer: Trainer) -> bool:
    """Whether Lightning runs validation right after the training batch that just ended (before the next one).

    Lightning resumes from a checkpoint written at such a batch's end by skipping that validation (its restart logic
    takes the validation for done), which changes what follows: metrics, best checkpoints, plateau schedulers, random
    states. It decides in ``fit_loop.epoch_loop._should_check_val_fx(data_fetcher)``, after the batch-end hooks.
    """
    loop = trainer.fit_loop.epoch_loop
    should_check = _require(loop, "_should_check_val_fx", "lightning", "exact resume (validation during an epoch)")
    return bool(should_check(fit_data_fetcher(trainer)))


def layer_sync_enabled(strategy: Strategy) -> bool:
    """Whether ``sync_batchnorm`` was asked for: the accelerator connector hands the strategy a ``_layer_sync``.

    ``strategy: dp`` refuses it (SyncBatchNorm works only between processes) rather than silently ignoring it.
    """
    return _require(strategy, "_layer_sync", "lightning", "strategy dp's sync_batchnorm check") is not None


# ---------------------------------------------------------------------------------------------------------------------
# Lightning: callback dispatch and loops (per-step cost, exact resume)

# The callback hooks Lightning calls on every batch.
STEP_HOOKS = tuple(
    f"on_{stage}_batch_{edge}" for stage in ("train", "validation", "test", "predict") for edge in ("start", "end")
) + ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


def skip_idle_step_hooks(callback: Callback) -> None:
    """Make Lightning pass over the per-batch hooks that ``callback``'s class leaves as ``Callback``'s no-ops.

    Lightning's ``_call_callback_hooks`` enters a profiler context and builds the callback's ``state_key`` for every
    hook of every callback on every batch, whether the hook does anything or not: ~5 us per callback and hook here,
    ~30 us per callback per training step, ~0.4 ms a step for the engine's dozen callbacks. It skips a hook that is
    not callable, so the idle ones are set to None on the instance (the class is untouched). Only for callbacks the
    engine (or Lightning) makes, never the user's.
    """
    for name in STEP_HOOKS:
        if getattr(type(callback), name) is getattr(Callback, name):
            setattr(callback, name, None)


def fit_data_fetcher(trainer: Trainer) -> Any:
    """The fit loop's data fetcher, which holds the iterator of the epoch being trained.

    Exact resume restores a sampler's generator after Lightning has built the epoch's iterator, and then builds it
    again (``iter(fetcher)``) so that the epoch draws from the restored state, as the uninterrupted run did.
    """
    return _require(trainer.fit_loop, "_data_fetcher", "lightning", "exact resume (sampler generators)")


def built_by_lightning_cli() -> bool:
    """Whether the LightningModule being constructed now is built by LightningCLI (True) or by hand (False).

    LightningCLI hands ``save_hyperparameters`` the module's configuration (``class_path`` dicts), from which
    ``load_from_checkpoint`` rebuilds the network and optimiser; built by hand those arguments are objects, which a
    ``weights_only`` checkpoint cannot hold. LightningCLI publishes the configuration in the context variable
    ``_given_hyperparameters`` while it calls the class.
    """
    from lightning.pytorch.core.mixins import hparams_mixin

    given = _require(hparams_mixin, "_given_hyperparameters", "lightning", "saving hyper-parameters")
    return given.get() is not None


# ---------------------------------------------------------------------------------------------------------------------
# Lightning and jsonargparse: the command line (commands/cli.py)


def print_config_action() -> Any:
    """jsonargparse's ``--print_config`` action: ``skip_print_config()`` defers the print, which
    ``print_config_if_requested(parser, config)`` then does with the configuration the run will use."""
    try:
        from jsonargparse._actions import _ActionPrintConfig
    except ImportError:
        raise _changed("jsonargparse", "_actions._ActionPrintConfig", "--print_config") from None
    for name in ("skip_print_config", "print_config_if_requested"):
        _require(_ActionPrintConfig, name, "jsonargparse", "--print_config")
    return _ActionPrintConfig


def instantiator_class() -> type:
    """LightningCLI's model instantiator (``_InstantiatorFn``), which records the config as hyper-parameters."""
    try:
        from lightning.pytorch.cli import _InstantiatorFn
    except ImportError:
        raise _changed("lightning", "cli._InstantiatorFn", "the model's hyper-parameters") from None
    return _InstantiatorFn


# ---------------------------------------------------------------------------------------------------------------------
# torch: in-place compilation (compile, strategy dp) and learning-rate schedulers (scaling)


def _compiled_call_check(module: nn.Module) -> None:
    # torch declares it on the class (None) and ``nn.Module.compile`` sets it on the instance.
    if not hasattr(nn.Module, "_compiled_call_impl"):
        raise _changed("torch", "nn.Module._compiled_call_impl", "torch.compile of the network (compile, dp)")


def is_compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` has run on this module (torch keeps the compiled call in ``_compiled_call_impl``).

    ``nn.Module.compile`` has no public query; compiling twice would wrap the compiled call again.
    """
    _compiled_call_check(module)
    return getattr(module, "_compiled_call_impl", None) is not None


def set_compiled_call(module: nn.Module, call: Callable[..., Any]) -> None:
    """Make ``module(...)`` run ``call`` instead of its eager forward, as ``module.compile()`` does.

    Strategy dp's replicas copy the original's compiled call, which is bound to the original's weights; each replica
    gets a call bound to itself.
    """
    _compiled_call_check(module)
    module._compiled_call_impl = call


def eager_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call ``module`` with its hooks but without its compiled call (``_call_impl``): what a compiled call wraps."""
    call = _require(module, "_call_impl", "torch", "torch.compile under strategy dp")
    return call(*args, **kwargs)


def child_schedulers(scheduler: Any) -> list[Any]:
    """The schedulers that ``SequentialLR`` and ``ChainedScheduler`` hold (in ``_schedulers``); [] for others.

    Learning-rate scaling must scale the rates those inner schedulers keep, or the next milestone undoes it.
    """
    if isinstance(scheduler, (torch.optim.lr_scheduler.SequentialLR, torch.optim.lr_scheduler.ChainedScheduler)):
        return list(_require(scheduler, "_schedulers", "torch", "learning-rate scaling (scaling.lr_scaling)"))
    return []


def last_lr_attribute(scheduler: Any) -> str | None:
    """The attribute where a torch scheduler keeps the rates ``get_last_lr()`` returns; None for other objects.

    Learning-rate scaling rewrites them with the others, so that ``get_last_lr()`` and the logged rate agree.
    """
    schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if not isinstance(scheduler, schedulers):
        return None
    _require(scheduler, "_last_lr", "torch", "learning-rate scaling (scaling.lr_scaling)")
    return "_last_lr"


# ---------------------------------------------------------------------------------------------------------------------
# Lightning: loggers (files left as they were when a save fails)


def built_experiment(logger: Any) -> Any:
    """The logger's experiment (CSV writer, SummaryWriter) if it has been created, else None; never creates one.

    Reading ``logger.experiment`` would create the writer (and its folder): the loggers ask first whether a save or
    ``finalize`` has anything on disk to protect. Lightning keeps it in ``logger._experiment``.
    """
    return _require(logger, "_experiment", "lightning", "leaving metrics.csv intact when a save fails")


# ---------------------------------------------------------------------------------------------------------------------
# Lightning and torch: strategy fsdp (FSDP2 through ModelParallelStrategy)


def _sharded_metadata_name() -> str:
    try:
        from lightning.fabric.utilities.load import _METADATA_FILENAME
    except ImportError:
        raise _changed("lightning", "fabric.utilities.load._METADATA_FILENAME", "sharded checkpoints (fsdp)") from None
    return _METADATA_FILENAME


# The file of a sharded checkpoint folder that holds everything but the shards (loops, callbacks, hyper-parameters);
# ModelParallelStrategy.load_checkpoint reads it by this name.
SHARDED_METADATA: str = _sharded_metadata_name()


def materialize_meta_module(module: nn.Module, device: torch.device) -> None:
    """Allocate, on ``device``, the parameters a module created on the meta device (ModelParallelStrategy.setup's
    step, kept by strategy fsdp, which replaces that method)."""
    try:
        from lightning.fabric.utilities.init import _materialize_distributed_module
    except ImportError:
        raise _changed("lightning", "fabric.utilities.init._materialize_distributed_module", "strategy fsdp") from None
    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: list[Any], device: torch.device) -> None:
    """Move optimizer states to ``device`` (ModelParallelStrategy.setup's last step, kept by strategy fsdp)."""
    try:
        from lightning.fabric.utilities.optimizer import _optimizers_to_device
    except ImportError:
        raise _changed("lightning", "fabric.utilities.optimizer._optimizers_to_device", "strategy fsdp") from None
    _optimizers_to_device(optimizers, device)


def checkpoint_wrapper(module: nn.Module) -> nn.Module:
    """``module`` whose activations are recomputed in the backward pass (torch's wrapper, which Lightning's FSDP and
    torchtitan use; its state_dict keys are the module's own)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap
    except ImportError:
        name = "distributed.algorithms._checkpoint.checkpoint_wrapper"
        raise _changed("torch", name, "fsdp checkpoint_layers") from None
    return wrap(module)


def set_data_parallel_size(strategy: ModelParallelStrategy, size: int) -> None:
    """Make the strategy's device mesh ``size`` data-parallel shards (strategy fsdp: one per process).

    ``ModelParallelStrategy`` takes the size only in its constructor, before the Trainer has given it devices, and
    its ``"auto"`` means one shard per node; ``setup_environment`` builds the mesh from ``_data_parallel_size``.
    """
    _require(strategy, "_data_parallel_size", "lightning", "strategy fsdp (one shard per process)")
    strategy._data_parallel_size = size


# ---------------------------------------------------------------------------------------------------------------------
# torch: the training DataLoader's resumable copy (exact resume, resume/loader.py)


def has_iterator(loader: Any) -> bool:
    """Whether a DataLoader has made its iterator: with persistent workers it keeps it (and its workers) in
    ``_iterator`` and resets it each epoch instead of making a new one, which draws the workers' seed."""
    return _require(loader, "_iterator", "torch", "exact resume (persistent workers)") is not None


def dataloader_copy(loader: Any, cls: type) -> Any:
    """A shallow copy of ``loader`` as an instance of ``cls`` (a subclass of its class), without its iterator: the
    copy must not share the original's persistent workers."""
    _require(loader, "_iterator", "torch", "exact resume (the training loader's copy)")
    copy = cls.__new__(cls)
    copy.__dict__.update(vars(loader), _iterator=None)
    return copy


# ---------------------------------------------------------------------------------------------------------------------
# Optuna: the sweep's sampler


def queued_values(trial: Any) -> dict[str, Any]:
    """The values ``study.enqueue_trial`` gave a trial (a FrozenTrial): Optuna keeps them in a system attribute that
    its trials read, and offers no public accessor."""
    return trial.system_attrs.get("fixed_params", {})
