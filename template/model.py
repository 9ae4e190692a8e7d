"""The LightningModule: a classifier around an injected network."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from template.engine import ConfigError, built_by_lightning_cli


class Classifier(LightningModule):
    """Trains any ``net`` that maps a batch of inputs to class logits, with cross-entropy."""

    def __init__(
        self,
        net: nn.Module,
        num_classes: int | None = None,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        if num_classes is None or num_classes < 2:
            raise ConfigError(
                f"model.num_classes is {num_classes}; give the DataModule a `num_classes` attribute "
                "or set model.num_classes (at least 2)"
            )
        # Built by LightningCLI, `net` and the optimiser arrive as class_path configs, which let load_from_checkpoint
        # rebuild them. Built by hand they are objects (a module, a class, a lambda) that weights_only loading refuses.
        self.save_hyperparameters(ignore=[] if built_by_lightning_cli() else ["net", "optimizer", "scheduler"])
        self.net = net
        self.num_classes = num_classes
        self.optimizer = optimizer
        self.scheduler = scheduler
        # One metric object per stage: their states must not mix, and torchmetrics syncs them across ranks. Their
        # updates never wait for the GPU: plain accuracy (the per-class "macro" average counts with torch.bincount,
        # which reads its input's range on the host), no per-update checks of the inputs or for NaNs.
        self.train_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.test_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.train_loss = MeanMetric(nan_strategy="disable")
        self.val_loss = MeanMetric(nan_strategy="disable")
        self.test_loss = MeanMetric(nan_strategy="disable")

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self._logits(x)
        losses = F.cross_entropy(logits, y, reduction="none")  # per sample: the epoch's mean weighs every sample
        loss = losses.mean()
        self.train_acc.update(logits, y)
        self.train_loss.update(losses)
        # Logged each step without waiting for the GPU: the bar and the loggers read the value when they show it.
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("train_acc", self.train_acc)
        self.log("train_loss_epoch", self.train_loss)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self._logits(x)
        self.val_acc.update(logits, y)
        self.val_loss.update(F.cross_entropy(logits, y, reduction="none"))

    def on_validation_epoch_end(self) -> None:
        self.log("val_loss", self.val_loss)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self._logits(x)
        self.test_acc.update(logits, y)
        self.test_loss.update(F.cross_entropy(logits, y, reduction="none"))

    def on_test_epoch_end(self) -> None:
        self.log("test_loss", self.test_loss)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """Predicted class per sample; labels in the batch, if any, are ignored."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(dim=-1)

    def _logits(self, x: Tensor) -> Tensor:
        logits = self(x)
        if logits.shape[-1] != self.num_classes:
            raise ConfigError(
                f"the network returns {logits.shape[-1]} logits per sample but model.num_classes is "
                f"{self.num_classes}; make the network's output size match the number of classes"
            )
        return logits

    def configure_optimizers(self):  # noqa: ANN201 - Lightning accepts several return shapes
        optimizer = self.optimizer(self.parameters())
        if self.scheduler is None:
            return optimizer
        scheduler = self.scheduler(optimizer)
        # Plateau schedulers step on a metric, the others on epochs.
        monitor = {"monitor": "val_loss"} if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) else {}
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, **monitor}}
