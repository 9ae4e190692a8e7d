"""The LightningModule: a classifier around an injected network."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
from torch import Tensor, nn
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from template.engine.errors import ConfigError


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
        from_config = _given_hyperparameters.get() is not None
        self.save_hyperparameters(ignore=[] if from_config else ["net", "optimizer", "scheduler"])
        self.net = net
        self.num_classes = num_classes
        self.optimizer = optimizer
        self.scheduler = scheduler
        # One metric object per stage: their states must not mix, and torchmetrics syncs them across ranks.
        self.train_acc = MulticlassAccuracy(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)
        self.test_acc = MulticlassAccuracy(num_classes)
        self.train_loss = MeanMetric()
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        # Training predictions waiting to enter the metrics: one bulk update per logging step costs less than
        # a torchmetrics update (~0.1 ms) and a `self.log` (~1 ms) on every step, and gives the same epoch values.
        self._pending: list[tuple[Tensor, Tensor, Tensor]] = []

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
        self._pending.append((logits.detach().argmax(dim=-1), y, loss.detach()))
        if self._is_logging_step():
            self._update_train_metrics()
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self._update_train_metrics()
        self.log("train_acc", self.train_acc)
        self.log("train_loss_epoch", self.train_loss)

    def _is_logging_step(self) -> bool:
        """True on the steps at which the Trainer writes to its loggers (every ``trainer.log_every_n_steps``)."""
        every = self.trainer.log_every_n_steps
        # global_step counts optimizer steps; +1 because it is read before this step's update, as Lightning does.
        return every > 0 and (self.trainer.global_step + 1) % every == 0

    def _update_train_metrics(self) -> None:
        if not self._pending:
            return
        preds, targets, losses = zip(*self._pending, strict=True)
        self._pending.clear()
        self.train_acc.update(torch.cat(preds), torch.cat(targets))
        sizes = torch.tensor([len(t) for t in targets], dtype=losses[0].dtype, device=losses[0].device)
        self.train_loss.update(torch.stack(losses), sizes)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, y, loss = self._logits_and_loss(batch)
        self.val_acc.update(logits, y)
        self.val_loss.update(loss, len(y))

    def on_validation_epoch_end(self) -> None:
        self.log("val_loss", self.val_loss)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, y, loss = self._logits_and_loss(batch)
        self.test_acc.update(logits, y)
        self.test_loss.update(loss, len(y))

    def on_test_epoch_end(self) -> None:
        self.log("test_loss", self.test_loss)
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
