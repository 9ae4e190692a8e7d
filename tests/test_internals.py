"""Every private name the engine reaches in another package (engine/internals.py), exercised for real.

A release of Lightning, jsonargparse, torchdata or torch that renames or changes one of them fails here, instead of
silently switching a guarantee off (the hang watchdog, exact resume, preemption).
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from jsonargparse import ArgumentParser
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from torch.utils.data import DataLoader

from template.engine import internals
from template.engine.strategies.scaling import scale_learning_rates


def _trainer(**kwargs) -> Trainer:  # noqa: ANN003
    options = {
        "accelerator": "cpu", "devices": 1, "max_steps": 3, "limit_val_batches": 0, "logger": False,
        "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
    }  # fmt: skip
    return Trainer(**{**options, **kwargs})


class _Recording(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []


def test_exit_handlers_run_now_as_at_the_interpreters_exit() -> None:
    code = (
        f"import atexit, os; from {internals.__name__} import run_exit_handlers; atexit.register(print, 'ran'); "
        "run_exit_handlers(); print('then'); os._exit(0)"  # as a process multiprocessing started ends
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["ran", "then"], done.stderr[-3000:]


def test_missing_name_fails_loudly_with_package_version_and_fix() -> None:
    with pytest.raises(internals.InternalsChanged, match=r"lightning \d+\.\d+.*`object\._timeout`.*README"):
        internals._require(object(), "_timeout", "lightning", "the hang watchdog")
    with pytest.raises(internals.InternalsChanged, match=r"torch \S+ .*`torch\.nn\._gone`.*README"):
        internals._imported("torch.nn", "_gone", "the hang watchdog")


# --- process groups -------------------------------------------------------------------------------------------------


def _built_by_the_command_line(*options: str) -> Trainer:
    """The Trainer ``fit`` would build with ``options`` (built only: nothing runs)."""
    from template.engine.commands.cli import build_cli

    quiet = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_progress_bar=false"]
    return build_cli([*quiet, *options], run=False).trainer


@pytest.mark.parametrize(
    "strategy",
    [
        ["--trainer.strategy=ddp"],
        ["--trainer.strategy=fsdp"],
        ["--trainer.strategy=ddp_spawn"],
        ["--trainer.strategy.class_path=lightning.pytorch.strategies.DDPStrategy"],
        [],  # auto: Lightning picks ddp for two devices
    ],
    ids=["ddp", "fsdp", "ddp_spawn", "class_path", "auto"],
)
def test_watchdog_timeout_reaches_the_process_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, strategy: list[str]
) -> None:
    """The watchdog's timeout is what Lightning passes to ``init_process_group``, however the strategy is named; it
    is ``strategy._timeout``, which a torchrun restart reads to create the group itself, as is the backend."""
    import torch.distributed as dist
    from lightning.pytorch.strategies import StrategyRegistry

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)  # Lightning sets them when it creates the group: put back after the test
    monkeypatch.chdir(tmp_path)
    strategy = _built_by_the_command_line(*strategy, "--trainer.devices=2", "--watchdog.timeout=7").strategy
    assert internals.process_group_timeout(strategy) == timedelta(seconds=7)
    assert internals.process_group_backend(strategy) == "gloo"
    assert "timeout" not in StrategyRegistry["ddp"]["init_params"], "Lightning's registry is as it was"

    class Created(Exception):
        """What Lightning asked of torch.distributed; the group itself would wait for the second process."""

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise Created({**kwargs, "backend": args[0] if args else kwargs.get("backend")})

    monkeypatch.setattr(dist, "init_process_group", recording)
    with pytest.raises(Created) as created:
        strategy.setup_environment()
    assert created.value.args[0]["timeout"] == timedelta(seconds=7) and created.value.args[0]["backend"] == "gloo"


def test_an_explicit_strategy_timeout_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    explicit = ["--trainer.strategy=lightning.pytorch.strategies.DDPStrategy", "--trainer.strategy.timeout=0:00:42"]
    strategy = _built_by_the_command_line(*explicit, "--watchdog.timeout=7").strategy
    assert internals.process_group_timeout(strategy) == timedelta(seconds=42)
    # Built from objects of its own (the config holds them as classes), it is not built again: a warning says so.
    environment = "lightning.fabric.plugins.environments.LightningEnvironment"
    own = [
        "--trainer.strategy=lightning.pytorch.strategies.DDPStrategy",
        f"--trainer.strategy.cluster_environment={environment}",
    ]
    with pytest.warns(UserWarning, match="set trainer.strategy.init_args.timeout"):
        strategy = _built_by_the_command_line(*own, "--watchdog.timeout=7").strategy
    assert internals.process_group_timeout(strategy) == timedelta(minutes=30)


def test_no_process_group_no_timeout() -> None:
    strategy = _trainer().strategy
    assert internals.process_group_timeout(strategy) is None and internals.process_group_backend(strategy) is None


def test_launched_children_are_the_ddp_launchers_processes() -> None:
    """``_SubprocessScriptLauncher.procs``: the watchdog finds the ranks it must kill."""
    trainer = _trainer(strategy="ddp", devices=2)
    assert internals.launched_children(trainer) is None  # nothing launched yet
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        trainer.strategy.launcher.procs.append(child)
        assert internals.launched_children(trainer) == [child]
    finally:
        child.wait(timeout=60)
    assert internals.launched_children(_trainer()) is None


def test_on_child_failure_replaces_the_launchers_sigkill() -> None:
    """``_ChildProcessObserver._terminate_all``: a child rank exiting non-zero reaches the watchdog, which reports which
    rank died and how, instead of Lightning SIGKILLing the job (here a stand-in process) without a word."""
    import threading

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    assert not internals.on_child_failure(lambda: None)  # no launcher watches children here
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    called = threading.Event()
    # It first looks after a second, long after the watchdog (in the launched run's setup) has replaced its kill.
    observer = _ChildProcessObserver(main_pid=job.pid, child_processes=[child], sleep_period=1)
    try:
        observer.start()
        assert internals.on_child_failure(called.set)
        assert called.wait(timeout=60)
        observer.join(timeout=10)
        assert job.poll() is None, "the launcher's SIGKILL still went out"
    finally:
        job.kill()
        job.wait(timeout=10)
        child.wait(timeout=60)


def test_cluster_environment_under_a_single_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_accelerator_connector.cluster_environment``: preemption reads SLURM's requeue settings from it."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    for name, value in {"SLURM_NTASKS": "1", "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "job", "SLURM_PROCID": "0",
                        "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    environment = SLURMEnvironment(auto_requeue=False, requeue_signal=signal.SIGHUP)
    trainer = _trainer(plugins=[environment])
    assert isinstance(trainer.strategy, SingleDeviceStrategy)
    found = internals.cluster_environment(trainer)
    assert found is environment and found.requeue_signal == signal.SIGHUP


def test_stop_as_on_sigterm_ends_the_run_with_sigterm_exception() -> None:
    """``_signal_connector.received_sigterm``: the run stops after this step and raises what gives the exit code."""

    class StopAtStep2(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # noqa: ANN001, ANN002
            if trainer.global_step == 2:
                internals.stop_as_on_sigterm(trainer)

    trainer = _trainer(max_steps=10, callbacks=[StopAtStep2()])
    with pytest.raises(SIGTERMException):
        trainer.fit(BoringModel())
    assert trainer.global_step == 2 and trainer.received_sigterm


def test_a_sigterm_lightning_received_is_forgotten_when_taken_over() -> None:
    """``received_sigterm = False``: a SIGTERM Lightning's handler recorded no longer ends the run after a step."""

    class TakeOverAtStep2(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # noqa: ANN001, ANN002
            if trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler, installed for the fit, records it
                internals.stop_as_on_sigterm(trainer, stop=False)

    trainer = _trainer(max_steps=5, callbacks=[TakeOverAtStep2()])
    trainer.fit(BoringModel())
    assert trainer.global_step == 5 and not trainer.received_sigterm


def test_accumulating_and_validation_follows_are_what_lightning_does_after_the_batch() -> None:
    """``_should_accumulate()`` and ``_should_check_val_fx(fetcher)`` read at a batch's end: whether the optimizer
    skipped this batch, and whether a validation runs before the next one (where a stop must not write a checkpoint)."""
    seen: list[tuple[int, bool, bool]] = []
    validated_after: list[int] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            seen.append((batch_idx, internals.accumulating(trainer), internals.validation_follows(trainer)))

        def on_validation_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            validated_after.append(seen[-1][0])

    options = {"max_steps": -1, "max_epochs": 1, "limit_train_batches": 6, "limit_val_batches": 1}
    trainer = _trainer(
        **options, val_check_interval=0.5, accumulate_grad_batches=2, num_sanity_val_steps=0, callbacks=[Record()]
    )
    trainer.fit(BoringModel())
    assert [accumulating for _, accumulating, _ in seen] == [True, False, True, False, True, False]
    assert [i for i, _, follows in seen if follows] == validated_after == [2, 5]


def test_a_resumed_epoch_whose_restart_is_ended_steps_its_plateau_scheduler(tmp_path: Path) -> None:
    """``fit_loop._restarting``: true for the whole epoch a fit resumes in the middle of, so Lightning does not step
    ReduceLROnPlateau at its end; set false at the epoch's end, Lightning steps it (under ``max_steps`` too)."""
    checkpoint = tmp_path / "mid-epoch.ckpt"
    restarting: list[bool] = []

    class Plateau(BoringModel):
        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            output = super().training_step(batch, batch_idx)
            self.log("loss", output["loss"])
            return output

        def configure_optimizers(self):  # noqa: ANN201
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "loss"}}

    class SaveMidEpoch(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if batch_idx == 1:
                trainer.save_checkpoint(checkpoint)

    class EndRestart(Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            restarting.append(trainer.fit_loop.restarting)
            internals.end_restart(trainer)

    options = {"max_epochs": 1, "limit_train_batches": 4}
    _trainer(**options, max_steps=-1, callbacks=[SaveMidEpoch()]).fit(Plateau())
    steps = []
    for max_steps, callbacks in ((-1, []), (-1, [EndRestart()]), (100, [EndRestart()])):
        trainer = _trainer(**options, max_steps=max_steps, callbacks=callbacks)
        trainer.fit(Plateau(), ckpt_path=checkpoint)
        steps.append(trainer.lr_scheduler_configs[0].scheduler.last_epoch)
    assert restarting == [True, True] and steps == [0, 1, 1]


def test_layer_sync_follows_sync_batchnorm() -> None:
    """``strategy._layer_sync``: strategy dp refuses sync_batchnorm instead of ignoring it."""
    assert internals.layer_sync_enabled(_trainer(strategy="ddp", sync_batchnorm=True).strategy)
    assert not internals.layer_sync_enabled(_trainer(strategy="ddp").strategy)


# --- callback dispatch and loops ------------------------------------------------------------------------------------


def test_idle_step_hooks_are_skipped_and_busy_ones_still_run() -> None:
    """``_call_callback_hooks`` skips a hook that is not callable: idle per-batch hooks set to None cost nothing."""

    class Busy(Callback):
        def __init__(self) -> None:
            self.ends = 0

        def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
            self.ends += 1

    busy, idle = Busy(), Callback()
    for callback in (busy, idle):
        internals.skip_idle_step_hooks(callback)
    assert busy.on_train_batch_start is None and idle.on_train_batch_end is None and idle.on_before_backward is None
    assert callable(busy.on_train_batch_end) and type(idle).on_train_batch_end is Callback.on_train_batch_end
    _trainer(max_steps=3, limit_train_batches=3, limit_val_batches=2, callbacks=[busy, idle]).fit(_Recording())
    assert busy.ends == 3


def test_rebuilding_the_fetchers_iterator_draws_from_a_restored_generator() -> None:
    """``fit_loop._data_fetcher``: exact resume rebuilds the epoch's iterator after restoring a sampler generator."""
    dataset = RandomDataset(32, 12)
    generator = torch.Generator().manual_seed(1)
    restored = torch.Generator().manual_seed(123).get_state()
    expected = [b for b in DataLoader(dataset, batch_size=4, sampler=torch.utils.data.RandomSampler(
        dataset, generator=torch.Generator().manual_seed(0).set_state(restored)))]  # fmt: skip

    class Restore(Callback):
        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            generator.set_state(restored)
            iter(internals.fit_data_fetcher(trainer))

    class Model(_Recording):
        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            self.seen.append(batch.clone())
            return super().training_step(batch, batch_idx)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(
                dataset, batch_size=4, sampler=torch.utils.data.RandomSampler(dataset, generator=generator)
            )

    model = Model()
    _trainer(max_steps=3, callbacks=[Restore()]).fit(model)
    assert all(torch.equal(a, b) for a, b in zip(model.seen, expected, strict=True))


def test_built_by_lightning_cli_tells_the_cli_from_a_hand_built_module() -> None:
    """``hparams_mixin._given_hyperparameters``: set while LightningCLI builds the module, not otherwise."""
    from lightning.pytorch.cli import LightningCLI

    class Model(BoringModel):
        def __init__(self, width: int = 2) -> None:
            super().__init__()
            self.by_cli = internals.built_by_lightning_cli()

    assert Model().by_cli is False
    cli = LightningCLI(Model, run=False, args=["--trainer.logger=false"], save_config_callback=None)
    assert cli.model.by_cli is True


# --- the command line ------------------------------------------------------------------------------------------------


def test_print_config_can_be_deferred_and_then_printed(capsys: pytest.CaptureFixture) -> None:
    action = internals.print_config_action()
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--print_config", action=action)
    parser.add_argument("--epochs", type=int, default=1)
    with action.skip_print_config():
        config = parser.parse_args(["--epochs=3", "--print_config"])
    assert capsys.readouterr().out == ""  # deferred: the run may still change the config
    config.epochs = 4
    with pytest.raises(SystemExit) as exit_info:
        action.print_config_if_requested(parser, config)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == "epochs: 4"


def test_lightning_instantiator_records_the_links_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["probe"])  # LightningCLI would parse pytest's own arguments
    instantiator = internals.instantiator_class()

    class Probe(LightningCLI):
        def before_instantiate_classes(self) -> None:
            self.hparams_seen = None
            call = instantiator(cli=self, key="model")

            class Recording(LightningModule):
                def __init__(self, size: int = 1) -> None:
                    super().__init__()
                    self.save_hyperparameters()

            module = call(Recording, size=5, applied_instantiation_links={"model.size": 5})
            raise _Stop(dict(module.hparams))

    with pytest.raises(_Stop) as stop:
        Probe(BoringModel, args=["fit"], save_config_callback=None, seed_everything_default=0)
    assert stop.value.args[0]["size"] == 5


class _Stop(Exception):
    """Ends a LightningCLI right after its parse, carrying what a probe found."""


# --- torch -----------------------------------------------------------------------------------------------------------


def test_compiled_call_in_place() -> None:
    """``nn.Module._compiled_call_impl`` and ``_call_impl``: compile detection and dp's per-replica compiled call."""
    net = nn.Linear(3, 2)
    assert not internals.is_compiled_in_place(net)
    net.compile()  # lazy: nothing is compiled before the first call
    assert internals.is_compiled_in_place(net)

    replica = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    internals.set_compiled_call(replica, lambda *args, **kwargs: "compiled call")
    assert replica(x) == "compiled call"
    assert torch.equal(internals.eager_call(replica, x), nn.functional.linear(x, replica.weight, replica.bias))


def test_scaling_reaches_sequential_and_last_lr() -> None:
    """``SequentialLR._schedulers`` and ``_last_lr``: a scaled rate survives the milestone and get_last_lr agrees."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    first = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=1)
    second = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    sequential = torch.optim.lr_scheduler.SequentialLR(optimizer, [first, second], milestones=[2])
    assert internals.child_schedulers(sequential) == [first, second]
    assert internals.child_schedulers(first) == []
    assert internals.last_lr_attributes(second) == ("_last_lr",) and internals.last_lr_attributes(object()) == ()

    scale_learning_rates([optimizer], [sequential], 2.0)
    assert sequential.get_last_lr() == pytest.approx([0.2])
    for _ in range(3):
        optimizer.step()
        sequential.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)  # past the milestone: still scaled


def test_built_experiment_is_none_until_a_logger_creates_it(tmp_path) -> None:  # noqa: ANN001
    from template.engine.logs.loggers import ResumableCSVLogger, ResumableTensorBoardLogger

    for logger in (ResumableCSVLogger(tmp_path / "csv"), ResumableTensorBoardLogger(tmp_path / "tb")):
        assert internals.built_experiment(logger) is None
        assert not Path(logger.save_dir).exists(), "asking created nothing"
        built = logger.experiment
        assert internals.built_experiment(logger) is built


def test_lr_finder_without_bar_draws_no_bar_and_changes_nothing_else(capsys) -> None:  # noqa: ANN001
    from lightning.pytorch.tuner import Tuner

    with internals.lr_finder_without_bar():
        found = Tuner(_trainer()).lr_find(BoringModel(), num_training=5, early_stop_threshold=None, update_attr=False)
    assert "Finding best initial lr" not in capsys.readouterr().err
    assert len(found.results["lr"]) == 5  # the finder ran its steps
    Tuner(_trainer()).lr_find(BoringModel(), num_training=5, early_stop_threshold=None, update_attr=False)
    assert "Finding best initial lr" in capsys.readouterr().err  # Lightning's own, without the patch


def test_fsdp_helpers_do_what_model_parallel_strategy_does(tmp_path) -> None:  # noqa: ANN001
    # The name ModelParallelStrategy.load_checkpoint reads a sharded checkpoint's unsharded part from.
    from lightning.fabric.strategies.model_parallel import _load_checkpoint

    assert internals.SHARDED_METADATA == "meta.pt"
    assert "_METADATA_FILENAME" in _load_checkpoint.__code__.co_names

    # Parameters made on the meta device are allocated, with their initialisation run.
    with torch.device("meta"):
        layer = nn.Linear(3, 2)
    internals.materialize_meta_module(layer, torch.device("cpu"))
    assert layer.weight.device.type == "cpu" and layer.weight.abs().sum() > 0

    # Optimizer states follow to the device (a no-op move on the CPU, but the call must exist and run).
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    internals.optimizers_to_device([optimizer], torch.device("cpu"))
    assert optimizer.state[layer.weight]["exp_avg"].device.type == "cpu"

    # Activation checkpointing keeps the module's outputs, gradients and state_dict keys.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    wrapped = nn.Sequential(*[internals.checkpoint_wrapper(m) for m in copy.deepcopy(plain)])
    x = torch.randn(5, 3)
    plain(x).sum().backward()
    wrapped(x).sum().backward()
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    assert torch.equal(wrapped[0]._checkpoint_wrapped_module.weight.grad, plain[0].weight.grad)


def test_last_checkpoint_is_written_where_lightning_skipped_it(tmp_path: Path) -> None:
    """Lightning 2.6's ModelCheckpoint writes last.ckpt only at a step that saved a top-k checkpoint; the engine's
    subclass writes it at every validation (its private helpers are the ones internals names)."""
    from template.engine.resume.checkpoints import ModelCheckpoint

    class Flat(BoringModel):
        def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            self.log("score", 1.0)  # never improves

    def fit(callback: Callback) -> dict:
        trainer = Trainer(
            default_root_dir=tmp_path, max_epochs=3, limit_train_batches=2, limit_val_batches=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        )  # fmt: skip
        trainer.fit(Flat())
        return torch.load(Path(callback.dirpath) / "last.ckpt", weights_only=False)

    kwargs = {"monitor": "score", "mode": "max", "save_last": True}
    assert fit(ours := ModelCheckpoint(dirpath=tmp_path / "ours", **kwargs))["global_step"] == 6
    assert ours.state_key.startswith("ModelCheckpoint{")  # the key checkpoints were written with
    from lightning.pytorch.callbacks import ModelCheckpoint as Lightnings

    assert fit(Lightnings(dirpath=tmp_path / "lightnings", **kwargs))["global_step"] == 2  # what the subclass fixes


def test_fsdp_data_parallel_size_is_what_model_parallel_strategy_builds_its_mesh_from() -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size="auto", tensor_parallel_size=1)
    internals.set_data_parallel_size(strategy, 4)
    assert strategy._data_parallel_size == 4
    # setup_environment hands it to the device mesh ("auto" would become the number of nodes there).
    assert "_data_parallel_size" in ModelParallelStrategy.setup_environment.__code__.co_names


# --- torch: the training DataLoader's resumable copy ----------------------------------------------------------------


def test_a_dataloader_copy_shares_no_persistent_iterator() -> None:
    """``DataLoader._iterator``: made on the first epoch with persistent workers and kept; a copy starts without."""
    loader = DataLoader(torch.arange(8), batch_size=2, num_workers=1, persistent_workers=True)
    assert not internals.has_iterator(loader)
    first = [b.tolist() for b in loader]
    assert internals.has_iterator(loader)

    class Copy(DataLoader):
        pass

    copy = internals.dataloader_copy(loader, Copy)
    assert type(copy) is Copy and copy.dataset is loader.dataset and copy.batch_size == 2
    assert not internals.has_iterator(copy) and internals.has_iterator(loader)
    assert [b.tolist() for b in copy] == first and internals.has_iterator(copy)


def test_optuna_keeps_a_queued_trials_values_where_the_sweeps_sampler_reads_them() -> None:
    optuna = pytest.importorskip("optuna", reason="the sweep extra is not installed: pip install -e '.[sweep]'")
    seen = []

    class Recording(optuna.samplers.RandomSampler):
        def infer_relative_search_space(self, study, trial):  # noqa: ANN001, ANN201
            seen.append(internals.queued_values(trial))  # the trial as Optuna hands it to a sampler
            return {}

    study = optuna.create_study(sampler=Recording())
    study.enqueue_trial({"a": 2})
    assert internals.queued_values(study.get_trials(deepcopy=False)[0]) == {"a": 2}
    trial = study.ask()
    trial.suggest_int("b", 0, 3)  # a value the queue left to the sampler, which sees the queued ones
    assert seen == [{"a": 2}] and trial.suggest_int("a", 0, 3) == 2


def test_a_process_groups_timeout_is_set_and_its_collectives_then_run(tmp_path: Path) -> None:
    """torch's private setter of the default group's timeout (the watchdog's bound): it takes a new timeout, and the
    group still runs a collective after it."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        internals.set_process_group_timeout(timedelta(seconds=5))
        ones = torch.ones(2)
        dist.all_reduce(ones)
        assert ones.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
