"""``export --format onnx``: the network as an ONNX graph with a dynamic batch, checked in ONNX Runtime; one-line
refusals (a format that is not supported, the extra missing, a network torch.onnx cannot export)."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning
import numpy as np
import pytest
import torch
import yaml
from torch import Tensor, nn

from template.model import Classifier
from template.nets import MLP
from tests.commands import user_projects as projects
from tests.conftest import CONFIGS

PROJECTS = projects.__name__
EXTRA = "needs the onnx extra: pip install -e '.[onnx]'"


def _needs_the_extra() -> None:
    for module in ("onnxruntime", "onnxscript", "onnx"):
        pytest.importorskip(module, reason=EXTRA)


def _checkpoint(path: Path, net: nn.Module) -> Classifier:
    """A checkpoint as Lightning writes its weights (the part export reads), of the example module around ``net``."""
    torch.manual_seed(0)
    model = Classifier(net, num_classes=10)
    torch.save({"pytorch-lightning_version": lightning.__version__, "state_dict": model.state_dict()}, path)
    return model.eval()


class DataDependentBranch(nn.Module):
    """A network whose forward branches on the values of its input: torch.export cannot trace it."""

    # `sign` also keeps an argument that the data does not link (a net with only linked arguments fails to build).
    def __init__(self, input_shape: list[int], num_classes: int, sign: float = -1.0) -> None:
        super().__init__()
        self.linear = nn.Linear(64, num_classes)
        self.sign = sign

    def forward(self, x: Tensor) -> Tensor:
        x = x.flatten(1)
        if x.sum() > 0:
            return self.linear(x)
        return self.sign * self.linear(x)


def _one_line(done) -> str:  # noqa: ANN001
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith("error:") and done.stderr.count("\n") == 1, done.stderr
    return done.stderr


@pytest.mark.parametrize("module", [False, True], ids=["network", "whole-module"])
def test_example_exports_with_a_dynamic_batch_checked_in_onnx_runtime(tmp_path: Path, run_main, module: bool) -> None:  # noqa: ANN001
    _needs_the_extra()
    import onnxruntime

    model = _checkpoint(tmp_path / "last.ckpt", MLP((1, 8, 8), 10))
    args = ["--config", CONFIGS / "default.yaml", "--output", "out/net.onnx", *(["--module"] if module else [])]
    done = run_main("export", "last.ckpt", "--format", "onnx", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Wrote out/net.onnx, checked in ONNX Runtime on batches of 64 and 1" in done.stdout, done.stdout
    assert "atol 0.0001" in done.stdout
    # The batch is dynamic; the MLP's layers are sized by the other dimensions, which keep the example's sizes.
    net = "Classifier" if module else "MLP"
    assert f"it takes 'input' (batch, 1, 8, 8), numbers where {net} takes no other size, and gives output" in (
        done.stdout
    )
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["net.onnx"]  # one file, no temporary left

    # Served without the project: ONNX Runtime alone, batches of sizes the export never saw.
    session = onnxruntime.InferenceSession(str(tmp_path / "out/net.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input"]
    assert [o.name for o in session.get_outputs()] == ["output"]  # not the last operator's name (squeeze)
    assert isinstance(session.get_inputs()[0].shape[0], str)  # a symbolic batch dimension
    assert session.get_inputs()[0].shape[1:] == [1, 8, 8]
    for batch in (1, 3, 100):
        x = torch.rand(batch, 1, 8, 8)
        with torch.no_grad():
            expected = (model if module else model.net)(x).numpy()
        (got,) = session.run(None, {"input": x.numpy()})
        assert got.shape == (batch, 10)
        assert abs(got - expected).max() < 1e-4


def test_a_network_onnx_cannot_hold_is_one_line_naming_the_construct(tmp_path: Path, run_main) -> None:  # noqa: ANN001
    _needs_the_extra()
    _checkpoint(tmp_path / "last.ckpt", DataDependentBranch([1, 8, 8], 10))
    (tmp_path / "branch.yaml").write_text(
        "model:\n  init_args:\n    net:\n      class_path: tests.commands.test_onnx.DataDependentBranch\n"
    )
    config = ["--config", CONFIGS / "default.yaml", "--config", "branch.yaml"]
    line = _one_line(run_main("export", "last.ckpt", "--format", "onnx", *config, "--output", "net.onnx"))
    assert "DataDependentBranch cannot be exported to ONNX" in line, line
    assert "data-dependent" in line and "test_onnx.py:" in line and "if x.sum() > 0" in line, line
    assert "--format weights" in line
    assert not list(tmp_path.glob("*net.onnx*"))


def test_missing_extra_is_named(tmp_path: Path, run_main, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if not installed
    _checkpoint(tmp_path / "last.ckpt", MLP((1, 8, 8), 10))
    line = _one_line(run_main("export", "last.ckpt", "--format", "onnx", "--config", CONFIGS / "default.yaml"))
    assert "pip install -e '.[onnx]'" in line, line
    assert not (tmp_path / "last.onnx").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--format", "tflite"], "invalid choice: 'tflite'"),
        (["--module"], "--module and --config are for --format onnx"),
        (["--format", "onnx", "--output", "last.ckpt"], "is the checkpoint itself"),
    ],
    ids=["unsupported-format", "onnx-option-with-weights", "output-is-checkpoint"],
)
def test_export_mistakes_are_one_line(tmp_path: Path, run_main, args: list[str], fragment: str) -> None:  # noqa: ANN001
    _checkpoint(tmp_path / "last.ckpt", MLP((1, 8, 8), 10))
    before = (tmp_path / "last.ckpt").read_bytes()
    line = _one_line(run_main("export", "last.ckpt", *args))
    assert fragment in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert (tmp_path / "last.ckpt").read_bytes() == before


def test_without_a_config_the_run_folders_is_needed(tmp_path: Path, run_main) -> None:  # noqa: ANN001
    _needs_the_extra()
    _checkpoint(tmp_path / "last.ckpt", MLP((1, 8, 8), 10))
    line = _one_line(run_main("export", "last.ckpt", "--format", "onnx"))
    assert "no config.yaml in the run folder" in line and "--config" in line, line


@pytest.mark.slow
def test_a_real_runs_checkpoint_exports_with_its_own_config(tmp_path: Path, run_cli) -> None:  # noqa: ANN001
    _needs_the_extra()
    import onnxruntime

    fit = run_cli(
        "fit", "--config", CONFIGS / "default.yaml", "--trainer.accelerator=cpu", "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    checkpoint = tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt"
    done = run_cli("export", checkpoint, "--format", "onnx")  # the run folder's config.yaml builds the network
    assert done.returncode == 0, done.stderr[-3000:]
    model = Classifier.load_from_checkpoint(checkpoint, weights_only=True).eval()
    session = onnxruntime.InferenceSession(str(checkpoint.with_suffix(".onnx")), providers=["CPUExecutionProvider"])
    x = torch.rand(7, 1, 8, 8)
    with torch.no_grad():
        assert abs(session.run(None, {"input": x.numpy()})[0] - model.net(x).numpy()).max() < 1e-4


def _user_checkpoint(tmp_path: Path, model: lightning.LightningModule, data: str, **net_args: object) -> None:
    """A user's module as Lightning saves its weights (``last.ckpt``), and a config naming it and its data."""
    state = {"pytorch-lightning_version": lightning.__version__, "state_dict": model.state_dict()}
    torch.save(state, tmp_path / "last.ckpt")
    net = {"class_path": f"{PROJECTS}.{type(model.net).__name__}", "init_args": net_args}
    config = {"model": {"class_path": f"{PROJECTS}.{type(model).__name__}", "init_args": {"net": net}}}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump({**config, "data": {"class_path": f"{PROJECTS}.{data}"}}))


def _served(path: Path, x: Tensor) -> dict[str, np.ndarray]:
    """What ONNX Runtime alone (no project, no torch.onnx) gives for ``x``, by output name."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"input": x.numpy()}), strict=True))


@pytest.mark.timeout(120)
def test_a_text_net_exports_for_every_sentence_length(tmp_path: Path, run_main) -> None:  # noqa: ANN001
    # Batches padded to their longest sentence: the graph must take any length, not only the example batch's.
    _needs_the_extra()
    model = projects.TextClassifier(projects.BagOfEmbeddings()).eval()
    _user_checkpoint(tmp_path, model, "Sentences")
    done = run_main("export", "last.ckpt", "--format", "onnx", "--config", "user.yaml", "--prefix", "net.")
    assert done.returncode == 0, done.stderr[-3000:]
    data = projects.Sentences()
    data.setup("validate")
    example = next(iter(data.val_dataloader()))[0]
    line = f"checked in ONNX Runtime on batches of 32 and 1, at shapes (32, {example.shape[1]}), (1, "
    assert line in done.stdout and "it takes 'input' (batch, size1)" in done.stdout, done.stdout
    for length in (3, example.shape[1] + 17):  # lengths the example batch did not have
        words = torch.randint(1, 80, (5, length))
        with torch.no_grad():
            expected = model.net(words).numpy()
        assert abs(_served(tmp_path / "last.onnx", words)["output"] - expected).max() < 1e-4


@pytest.mark.slow  # two exports
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("named", "outputs"), [(False, ["output_0", "output_1"]), (True, ["shape", "area"])])
def test_every_head_is_an_output_of_its_own_at_any_image_size(tmp_path: Path, run_main, named, outputs) -> None:  # noqa: ANN001
    _needs_the_extra()
    model = projects.TwoHeads(projects.ShapeNet(named=named)).eval()
    _user_checkpoint(tmp_path, model, "ShapesData", named=named)
    done = run_main("export", "last.ckpt", "--format", "onnx", "--config", "user.yaml", "--output", "heads.onnx")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at shapes (32, 1, 16, 16), (1, 1, 8, 8), (32, 1, 24, 24)" in done.stdout, done.stdout
    assert "it takes 'input' (batch, 1, size2, size3)" in done.stdout and ", ".join(outputs) in done.stdout
    for size in (12, 40):  # a convolution and a global pooling take any image size
        images = torch.rand(3, 1, size, size)
        with torch.no_grad():
            logits, area = model._heads(images)
        served = _served(tmp_path / "heads.onnx", images)
        assert list(served) == outputs
        assert abs(served[outputs[0]] - logits.numpy()).max() < 1e-4 and served[outputs[0]].shape == (3, 3)
        assert abs(served[outputs[1]] - area.numpy()).max() < 1e-4 and served[outputs[1]].shape == (3,)


class Nested(nn.Module):
    """A net returning a tuple holding a dict: not a flat set of tensors."""

    def __init__(self, input_shape: list[int], num_classes: int, scale: float = 1.0) -> None:
        super().__init__()
        self.linear = nn.Linear(64, num_classes)
        self.scale = scale

    def forward(self, x: Tensor):
        logits = self.scale * self.linear(x.flatten(1))
        return logits, {"probabilities": logits.softmax(-1)}


def test_a_net_returning_what_onnx_cannot_name_is_one_line(tmp_path: Path, run_main) -> None:  # noqa: ANN001
    _needs_the_extra()
    _checkpoint(tmp_path / "last.ckpt", Nested([1, 8, 8], 10))
    (tmp_path / "nested.yaml").write_text(
        "model:\n  init_args:\n    net:\n      class_path: tests.commands.test_onnx.Nested\n"
    )
    config = ["--config", CONFIGS / "default.yaml", "--config", "nested.yaml"]
    line = _one_line(run_main("export", "last.ckpt", "--format", "onnx", *config))
    assert "Nested returns a tuple of ['Tensor', 'dict']" in line, line
    assert "a tensor, or a tuple, list or dict of tensors" in line and "--format weights" in line, line
    assert not list(tmp_path.glob("*.onnx*"))


class SizeBranch(nn.Module):
    """A network that takes any width but branches on it: torch.export keeps the branch the example took."""

    def __init__(self, input_shape: list[int], num_classes: int, sign: float = -1.0) -> None:
        super().__init__()
        self.linear = nn.Linear(8, num_classes)
        self.sign = sign

    def forward(self, x: Tensor) -> Tensor:
        logits = self.linear(x.mean(-1).flatten(1))
        return logits if x.shape[-1] > 4 else self.sign * logits


@pytest.mark.slow  # an export
@pytest.mark.timeout(120)
def test_a_graph_that_holds_only_for_some_sizes_is_refused_in_one_line(tmp_path: Path, run_main) -> None:  # noqa: ANN001
    _needs_the_extra()
    _checkpoint(tmp_path / "last.ckpt", SizeBranch([1, 8, 8], 10))
    (tmp_path / "branch.yaml").write_text(
        "model:\n  init_args:\n    net:\n      class_path: tests.commands.test_onnx.SizeBranch\n"
    )
    config = ["--config", CONFIGS / "default.yaml", "--config", "branch.yaml"]
    line = _one_line(run_main("export", "last.ckpt", "--format", "onnx", *config))
    # Checked at half the example's width, where PyTorch takes the other branch.
    assert "ONNX Runtime's 'output' differs from PyTorch's by" in line and "(1, 1, 8, 4)" in line, line
    assert "nothing was written" in line and not list(tmp_path.glob("*.onnx*"))
