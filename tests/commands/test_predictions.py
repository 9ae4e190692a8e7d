"""predict writes whatever a user's ``predict_step`` returns for each sample (docs/your-code.md): one file, a row per
sample in the input's order, a column per output; anything else is one line at the first batch."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from template.engine.commands.predictions import PredictionWriter
from template.engine.errors import ConfigError

LABELS = ("cat", "dog", "fox")


class Shapes(LightningDataModule):
    """10 samples of 4 features in batches of 4 (the last batch short), in order."""

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(40.0).reshape(10, 4)), batch_size=4)


class Heads(LightningModule):
    """A user's model whose ``predict_step`` returns what ``kind`` names."""

    def __init__(self, kind: str = "dict") -> None:
        super().__init__()
        self.kind = kind
        self.body = nn.Identity()
        self.batches = 0

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        self.batches += 1
        x = self.body(batch[0])
        return {
            "vector": x[:, 0],  # one number per sample
            "matrix": x[:, :3],  # three per sample
            "tuple": (x[:, 0], x[:, 1:3]),  # two heads, the second of two columns
            "dict": {"shape": x[:, 0].long() % 3, "area": x[:, 1] / 2},
            "strings": [LABELS[int(v) % 3] for v in x[:, 0]],
            "numbers": x[:, 0].tolist(),
            "loss": x.sum(),  # a mistake: one number for the batch
            "scalar": 0.5,
            "short": x[:2, 0],  # a row missing
        }[self.kind]


def _predict(tmp_path: Path, kind: str) -> tuple[list[str], list[list[str]]]:
    path = tmp_path / "predictions.csv"
    trainer = Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[PredictionWriter(str(path))]
    )
    trainer.predict(Heads(kind), datamodule=Shapes(), return_predictions=False)
    header, *rows = list(csv.reader(path.open(newline="")))
    assert [row[0] for row in rows] == [str(i) for i in range(10)], "a row per sample, in the input's order"
    return header, rows


# Each sample's first feature is 4 x its index; the second 4 x index + 1.
KINDS = {
    "vector": (["prediction"], lambda i: [4 * i]),
    "matrix": (["prediction_0", "prediction_1", "prediction_2"], lambda i: [4 * i, 4 * i + 1, 4 * i + 2]),
    "tuple": (["prediction_0", "prediction_1_0", "prediction_1_1"], lambda i: [4 * i, 4 * i + 1, 4 * i + 2]),
    "dict": (["shape", "area"], lambda i: [4 * i % 3, (4 * i + 1) / 2]),
    "numbers": (["prediction"], lambda i: [4 * i]),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_output_a_user_returns_is_a_column_per_value(tmp_path: Path, kind: str) -> None:
    header, rows = _predict(tmp_path, kind)
    names, expected = KINDS[kind]
    assert header == ["index", *names]
    for i, row in enumerate(rows):
        assert [float(value) for value in row[1:]] == [float(value) for value in expected(i)], row


def test_strings_are_written_as_they_are(tmp_path: Path) -> None:
    header, rows = _predict(tmp_path, "strings")
    assert header == ["index", "prediction"]
    assert [row[1] for row in rows] == [LABELS[4 * i % 3] for i in range(10)]


@pytest.mark.parametrize(
    "kind,what",
    [
        ("loss", "predict_step returned a tensor of shape () for a batch of 4 samples"),
        ("scalar", "predict_step returned a float for a batch of 4 samples"),
        ("short", "predict_step returned a tensor of shape (2,) for a batch of 4 samples"),
    ],
)
def test_another_output_is_one_line_at_the_first_batch(tmp_path: Path, kind: str, what: str) -> None:
    module = Heads(kind)
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[PredictionWriter()])
    with pytest.raises(ConfigError) as refused:
        trainer.predict(module, datamodule=Shapes(), return_predictions=False)
    assert str(refused.value) == (
        f"{what}; the predictions file takes a tensor with a row per sample, a tuple, list or dict of them, or a list "
        "of a number or string per sample"
    )
    assert module.batches == 1, "refused before the rest is predicted"


def test_a_refused_output_is_one_error_line_of_the_command(run_main: Any) -> None:
    model = f"--model={__name__}.Heads"
    result = run_main("predict", model, "--model.kind=loss", f"--data={__name__}.Shapes", "--trainer.accelerator=cpu")
    assert result.returncode == 2, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: predict_step returned a tensor of shape () for a batch of 4 samples; "), line
    assert "Traceback" not in result.stderr
