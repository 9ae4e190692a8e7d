"""The LightningModule: a classifier around an injected network."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
from torch import Tensor, nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

from template.errors import ConfigError


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
        # Built by LightningCLI, `net` arrives as its class_path config, which lets load_from_checkpoint rebuild it.
        # Built by hand it is a module object: the state_dict holds it already and weights_only loading refuses it.
        self.save_hyperparameters(ignore=[] if _given_hyperparameters.get() is not None else ["net"])
        self.net = net
        self.num_classes = num_classes
        self.optimizer = optimizer
        self.scheduler = scheduler
        # One metric object per stage: their states must not mix, and torchmetrics syncs them across ranks.
        self.train_acc = MulticlassAccuracy(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)
        self.test_acc = MulticlassAccuracy(num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _logits_and_loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        if logits.shape[-1] != self.num_classes:
            raise ConfigError(
                f"the network returns {logits.shape[-1]} logits per sample but model.num_classes is "
                f"{self.num_classes}; make the network's output size match the number of classes"
            )
        return logits, y, F.cross_entropy(logits, y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        logits, y, loss = self._logits_and_loss(batch)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, y, loss = self._logits_and_loss(batch)
        self.val_acc(logits, y)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, y, loss = self._logits_and_loss(batch)
        self.test_acc(logits, y)
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: Tensor | tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """Predicted class per sample; labels in the batch, if any, are ignored."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(dim=-1)

    def configure_optimizers(self):  # noqa: ANN201 - Lightning accepts several return shapes
        optimizer = self.optimizer(self.parameters())
        if self.scheduler is None:
            return optimizer
        scheduler = self.scheduler(optimizer)
        # Plateau schedulers step on a metric, the others on epochs.
        monitor = {"monitor": "val_loss"} if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) else {}
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, **monitor}}
