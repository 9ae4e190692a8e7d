"""``python -m template export CKPT``: a checkpoint's network as a plain ``state_dict``, or as an ONNX graph checked in
ONNX Runtime. ``load_weights`` loads that, a Lightning checkpoint, or a DP/DDP/compiled one into a bare module."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

from template.engine.commands.cli import CLI, PROGRAM, build_cli
from template.engine.errors import ConfigError, disk_errors, one_line
from template.engine.resume import checkpoints
from template.engine.runs import config_of
from template.engine.runs.remote import RemoteRoot, is_remote
from template.engine.store import atomic_torch_save, atomic_write

# Where the Classifier keeps its network: Lightning saves its weights as "net.<name>".
DEFAULT_PREFIX = "net."
# DataParallel's and DistributedDataParallel's "module.", torch.compile's "_orig_mod." (also around a submodule).
_WRAPPERS = re.compile(r"^(?:(?:module|_orig_mod)\.)+|(?<=\.)_orig_mod\.")
# ONNX Runtime's output must match PyTorch's within |ort - torch| <= ATOL + RTOL * |torch| (fp32).
ATOL, RTOL = 1e-4, 1e-3


def extract_state_dict(checkpoint: Any, prefix: str = DEFAULT_PREFIX, source: str = "the file") -> dict[str, Tensor]:
    """The bare network's weights inside ``checkpoint``, whichever way it was saved (Lightning's: the whole module)."""
    if isinstance(checkpoint, Mapping) and "pytorch-lightning_version" in checkpoint:
        state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
        if not state:
            found = sorted({k.split(".")[0] for k in checkpoint["state_dict"]})
            raise ConfigError(f"no weights under prefix '{prefix}' in {source} (it has {found}); pass --prefix")
    else:
        state = checkpoint
        for key in ("state_dict", "model_state_dict", "model"):  # the keys plain-PyTorch scripts save it under
            if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
                state = state[key]
                break
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ConfigError(f"{source} does not hold a state_dict (a mapping of names to tensors); pass a checkpoint")
    return {clean_key(k): v for k, v in state.items()}


def clean_key(key: str) -> str:
    """``key`` without the names that DataParallel, DistributedDataParallel and torch.compile add around it."""
    return _WRAPPERS.sub("", key)


def load_weights(
    module: nn.Module,
    path: str | os.PathLike,
    map_location: Any = "cpu",
    prefix: str = DEFAULT_PREFIX,
    strict: bool = True,
) -> nn.Module:
    """Load weights from ``path`` (exported, Lightning, DP/DDP or compiled checkpoint) into the bare ``module``."""
    state = extract_state_dict(checkpoints.load(path, map_location), prefix, source=f"'{path}'")
    module.load_state_dict(state, strict=strict)
    return module


class ArgumentParser(argparse.ArgumentParser):
    """argparse raising what it refuses as a ConfigError (one line), instead of printing its usage."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog.removeprefix(PROGRAM).strip()}: {message}")


class Refused(ConfigError):
    """ONNX Runtime refuses a size PyTorch takes (not a wrong answer, which no fixed size mends)."""


class FitConfig(CLI):
    """The command line building the model and data of a fit config, also as a run saved it (with ``ckpt_path``)."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--ckpt_path", type=str | None, default=None)
        parser.add_argument("--weights_only", type=bool | None, default=None)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        return None  # the model and the data only


def export_onnx(checkpoint_path: str, output: Path, configs: list[str], prefix: str, module: bool) -> str:
    """Write the net at ``prefix`` (or the module) as ONNX, every output checked in ONNX Runtime against PyTorch's,
    on the example input and at other sizes of its dynamic dimensions; the line saying how well, and what it takes."""
    try:
        import onnxruntime  # noqa: F401 - ONNXProgram runs the graph in it
        import onnxscript  # noqa: F401 - torch.onnx's exporter needs it
    except ImportError:
        raise ConfigError("--format onnx needs onnx, onnxscript and onnxruntime: pip install -e '.[onnx]'") from None
    target, x = _network(checkpoint_path, configs or [str(config_of(checkpoint_path))], prefix, module)
    with torch.no_grad():
        names, dynamic, lost = list(_outputs(target, x)), _dynamic(target, x), ""
        try:
            program, inputs, error = _checked(target, x, dynamic, names)
        except Refused:
            if not dynamic:
                raise
            # PyTorch takes other sizes; the graph torch.onnx makes of a layer (adaptive pooling) holds the example's.
            lost = f"; dimensions {', '.join(map(str, dynamic))} fixed (ONNX Runtime refused other sizes PyTorch takes)"
            dynamic = {}
            program, inputs, error = _checked(target, x, dynamic, names)
    axes = {0: "batch", **{d: f"size{d}" for d in dynamic}}
    with disk_errors(output, kept="nothing was written at --output", option="--output"):
        output.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(output, lambda f: f.write(program.model_proto.SerializeToString()))
    shapes = f", at shapes {', '.join(str(tuple(b.shape)) for b in inputs)}" if dynamic else ""
    shape = ", ".join(axes.get(d, str(n)) for d, n in enumerate(x.shape))
    fixed = (
        f", numbers where {type(target).__name__} takes no other size,"
        if len(dynamic) + 1 < x.dim() and not lost
        else ""
    )
    return (
        f"checked in ONNX Runtime on batches of {len(x)} and 1{shapes}: |difference| {error:.2g} (atol {ATOL}, rtol "
        f"{RTOL}); it takes 'input' ({shape}){fixed} and gives {', '.join(names)}{lost}"
    )


def _checked(target: nn.Module, x: Tensor, dynamic: dict[int, tuple[int, int]], names: list[str]) -> tuple:
    """The program of ``target`` with the batch and the ``dynamic`` dimensions named, the inputs it was checked on
    (the example, a batch of 1 with the other dynamic dimensions smaller, one with them larger), its largest
    difference from PyTorch."""
    program = _traced(target, x, {0: "batch", **{d: f"size{d}" for d in dynamic}}, names)
    inputs = [x, _resized(x, {0: 1, **{d: smaller for d, (smaller, _) in dynamic.items()}})]
    inputs += [_resized(x, {d: larger for d, (_, larger) in dynamic.items()})] if dynamic else []
    return program, inputs, max(_difference(program, target, b) for b in inputs)


def _network(checkpoint_path: str, configs: list[str], prefix: str, module: bool) -> tuple[nn.Module, Tensor]:
    """The net at ``prefix`` (or the module) that the run's config builds, with the checkpoint's weights, in eval
    mode, and the example input: one batch of the config's DataModule."""
    if not Path(configs[0]).is_file():
        raise ConfigError(f"no config.yaml in the run folder of '{checkpoint_path}'; pass the run's --config")
    state = extract_state_dict(checkpoints.load(checkpoint_path), "", source=f"'{checkpoint_path}'")
    cli = build_cli([arg for config in configs for arg in ("--config", config)], False, FitConfig)
    try:
        cli.model.load_state_dict(state)
    except RuntimeError as err:
        raise ConfigError(f"'{checkpoint_path}' does not fit the config's model: {one_line(str(err))[:300]}") from None
    target = (cli.model if module else cli.model.get_submodule(prefix.rstrip("."))).cpu().eval()
    return target, _example_input(cli.datamodule).cpu()


def _outputs(target: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """What ``target`` returns on ``x`` by its names in the graph: ``output``, a tuple's ``output_0``, ``output_1``,
    ..., or a dict's keys (in its order, which torch.export keeps)."""
    value = target(x)
    named = {"output": value} if isinstance(value, Tensor) else value if isinstance(value, Mapping) else {}
    named = dict(enumerate(value)) if isinstance(value, (tuple, list)) else named
    if not named or not all(isinstance(tensor, Tensor) for tensor in named.values()):
        kinds = sorted({type(v).__name__ for v in named.values()})
        raise ConfigError(
            f"{type(target).__name__} returns a {type(value).__name__}{f' of {kinds}' * bool(kinds)}; --format onnx "
            "exports a tensor, or a tuple, list or dict of tensors: return those from forward, or export the weights "
            "(--format weights)"
        )
    return {f"output_{name}" if isinstance(name, int) else str(name): tensor for name, tensor in named.items()}


def _resized(x: Tensor, sizes: dict[int, int]) -> Tensor:
    """``x`` cut or repeated along each dimension to the size given: still values of the data (token ids stay ids)."""
    for dim, size in sizes.items():
        x = x.repeat(*[-(-size // x.shape[dim]) if d == dim else 1 for d in range(x.dim())]).narrow(dim, 0, size)
    return x


def _dynamic(target: nn.Module, x: Tensor) -> dict[int, tuple[int, int]]:
    """The dimensions besides the batch that ``target`` takes other sizes of (not those a layer is sized by), each
    with the smaller and the larger size it ran at."""
    sizes = {d: (max(1, n // 2), n + max(1, n // 2)) for d, n in enumerate(x.shape) if d > 0}
    return {d: other for d, other in sizes.items() if all(_runs(target, _resized(x, {d: n})) for n in other)}


def _runs(target: nn.Module, x: Tensor) -> bool:
    """Whether ``target`` runs on ``x``."""
    try:
        target(x)
    except Exception:  # a refusal, whatever the net raises, is the answer (the example's own sizes ran)
        return False
    return True


def _traced(target: nn.Module, x: Tensor, dynamic: dict[int, str], names: list[str]) -> Any:
    """torch.onnx's program of ``target`` with the ``dynamic`` dimensions named; a ConfigError naming what stops it."""
    logger, quiet = logging.getLogger("torch"), io.StringIO()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:  # torch.export prints its graphs when it fails, and warns of torchvision's operators
        with warnings.catch_warnings(), contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            warnings.simplefilter("ignore")
            return torch.onnx.export(target, (x,), dynamic_shapes=(dynamic,), input_names=["input"], output_names=names)
    except torch.onnx.OnnxExporterError as err:
        raise ConfigError(f"{type(target).__name__} cannot be exported to ONNX: {_construct(err)}") from None
    finally:
        logger.setLevel(level)


def _difference(program: Any, target: nn.Module, x: Tensor) -> float:
    """The largest |ONNX Runtime - PyTorch| over the outputs on ``x``; a ConfigError where one is out of tolerance."""
    try:
        got = program(x)
    except Exception as err:  # onnxruntime's own types: a size the graph does not take after all
        raise Refused(
            f"ONNX Runtime refuses an input of shape {tuple(x.shape)}, which PyTorch takes: "
            f"{one_line(str(err))[:300]}; nothing was written"
        ) from None
    worst = 0.0
    for (name, want), have in zip(_outputs(target, x).items(), got, strict=True):
        difference = float((have.double() - want.double()).abs().max()) if have.shape == want.shape else math.inf
        if not difference <= ATOL + RTOL * float(want.double().abs().max()):
            raise ConfigError(
                f"ONNX Runtime's '{name}' differs from PyTorch's by {difference:.3g} on an input of shape "
                f"{tuple(x.shape)}; nothing was written"
            )
        worst = max(worst, difference)
    return worst


def _example_input(datamodule: LightningDataModule) -> Tensor:
    """The input of one batch of the DataModule's val (else predict) loader: the batch, or its first element."""
    for stage, loader in (("validate", "val_dataloader"), ("predict", "predict_dataloader")):
        if is_overridden(loader, datamodule, LightningDataModule):
            datamodule.prepare_data()
            datamodule.setup(stage)
            batch = next(iter(getattr(datamodule, loader)()))
            return batch[0] if isinstance(batch, (list, tuple)) else batch
    raise ConfigError(f"{type(datamodule).__name__} has no val_dataloader or predict_dataloader for an example input")


def _construct(err: BaseException) -> str:
    """The construct torch.onnx's exporter stopped at, and where in the user's code, in one line."""
    while err.__cause__ is not None and "raised this error" not in str(err):
        err = err.__cause__
    where = re.search(r'raised this error:\s*File "([^"]+)", line (\d+), in \w+\s*\n\s*(.+)', str(err))
    place = f" at {where[1]}:{where[2]} `{where[3].strip()}`" if where else ""
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{one_line(str(err))[:300]}{place}; change that code, or export the weights (--format weights)"


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m template export CKPT [--output FILE] [--prefix net.] [--format onnx [--module] [--config FILE]]``."""
    parser = ArgumentParser(
        prog=f"{PROGRAM} export",
        description="Write the bare network's state_dict from a checkpoint (it loads with weights_only=True), "
        "or with --format onnx the network as an ONNX graph checked in ONNX Runtime.",
    )
    parser.add_argument("ckpt_path", help="a Lightning checkpoint (or a DP/DDP/compiled plain-PyTorch one)")
    parser.add_argument("--output", help="where to write it (default: CKPT with suffix .pt, or .onnx)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="attribute of the LightningModule holding the net")
    parser.add_argument("--format", choices=("weights", "onnx"), default="weights", help="a state_dict, or ONNX")
    parser.add_argument("--module", action="store_true", help="onnx: the whole LightningModule, not the net")
    parser.add_argument("--config", action="append", help="onnx: the run's config (default: its config.yaml)")
    args = parser.parse_args(argv)
    if args.format == "weights" and (args.module or args.config):
        raise ConfigError("--module and --config are for --format onnx; the weights need neither")
    target = args.output or re.sub(r"\.[^./]*$", "", args.ckpt_path) + (".onnx" if args.format == "onnx" else ".pt")
    if target == args.ckpt_path or (not is_remote(target) and Path(target).resolve() == Path(args.ckpt_path).resolve()):
        raise ConfigError(f"--output '{target}' is the checkpoint itself; choose another file name")
    remote = next(
        (RemoteRoot(url.rsplit("/", 1)[0], option="export") for url in (args.ckpt_path, target) if is_remote(url)), None
    )
    try:
        ckpt, configs = _local_inputs(args, remote)
        output = Path(remote.fetched / "export" / Path(target).name) if is_remote(target) else Path(target)
        if args.format == "onnx":
            checked = export_onnx(ckpt, output, configs, args.prefix, args.module)
            done = f", {checked}: onnxruntime.InferenceSession('{target}').run(None, {{'input': x}})"
        else:
            state = extract_state_dict(checkpoints.load(ckpt), args.prefix, source=f"'{args.ckpt_path}'")
            with disk_errors(output, kept="nothing was written at --output", option="--output"):
                output.parent.mkdir(parents=True, exist_ok=True)
                atomic_torch_save(state, output)  # atomic: a failed write leaves nothing at --output
            done = f": net.load_state_dict(torch.load('{target}', weights_only=True))"
        if is_remote(target):
            remote.upload(output, target)
    finally:
        if remote is not None:
            remote.close()
    print(f"Wrote {target}{done}")


def _local_inputs(args: argparse.Namespace, remote: RemoteRoot | None) -> tuple[str, list[str]]:
    """The checkpoint and the config files, downloaded where CKPT is on object storage (its run's config.yaml too,
    for onnx)."""
    if remote is None or not is_remote(args.ckpt_path):
        return args.ckpt_path, args.config or []
    ckpt = remote.download(args.ckpt_path, "export's CKPT")
    if args.format == "onnx" and not args.config:
        return ckpt, [remote.download(str(config_of(args.ckpt_path)), "--config")]
    return ckpt, args.config or []
