"""Three small user projects unlike the example and unlike each other, for ``tune lr`` and ``export --format onnx``:
a text classifier (its own vocabulary, an embedding and pooling over batches padded to their longest sentence, macro
F1), an image model with two heads (a convolution with global pooling, class and area, a weighted sum of two losses)
and a regression MLP trained with SGD (R2). Used from YAML by ``class_path`` only."""

from collections import Counter

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import R2Score
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

# Text: each topic has its own words, mixed into sentences of common ones.
TOPICS = [["goal", "match", "team", "score"], ["stock", "market", "price", "bank"], ["rain", "storm", "wind", "sun"]]
FILLER = [f"w{i}" for i in range(60)]


def sentences(count: int, seed: int) -> tuple[list[list[str]], list[int]]:
    """``count`` sentences of 3 to 30 words (a quarter of them the topic's words) and their topics."""
    generator = torch.Generator().manual_seed(seed)
    texts, labels = [], []
    for _ in range(count):
        topic, length = (
            int(torch.randint(3, (1,), generator=generator)),
            int(torch.randint(3, 31, (1,), generator=generator)),
        )
        words = [FILLER[int(i)] for i in torch.randint(len(FILLER), (length,), generator=generator)]
        for position in torch.randperm(length, generator=generator)[: max(1, length // 4)]:
            words[int(position)] = TOPICS[topic][int(torch.randint(4, (1,), generator=generator))]
        texts.append(words)
        labels.append(topic)
    return texts, labels


class Sentences(LightningDataModule):
    """Sentences as word indices, a vocabulary counted on the training split (0 pads, 1 is an unknown word)."""

    num_classes = 3

    def __init__(self, batch_size: int = 32, vocab_size: int = 80) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.vocab_size = vocab_size

    def setup(self, stage: str) -> None:
        (train, train_y), (val, val_y) = sentences(640, seed=1), sentences(256, seed=2)
        counts = Counter(word for words in train for word in words)
        self.vocabulary = {word: i + 2 for i, (word, _) in enumerate(counts.most_common(self.vocab_size - 2))}
        self.train = [(self.encode(words), label) for words, label in zip(train, train_y, strict=True)]
        self.val = [(self.encode(words), label) for words, label in zip(val, val_y, strict=True)]

    def encode(self, words: list[str]) -> torch.Tensor:
        return torch.tensor([self.vocabulary.get(word, 1) for word in words])

    @staticmethod
    def pad(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pads every sentence to the batch's longest."""
        return pad_sequence([words for words, _ in batch], batch_first=True), torch.tensor([y for _, y in batch])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, collate_fn=self.pad)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=self.pad)


class BagOfEmbeddings(nn.Module):
    """The mean of the words' embeddings (padding left out), then a hidden layer."""

    def __init__(self, vocab_size: int = 80, width: int = 32, classes: int = 3) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, width, padding_idx=0)
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        mask = (words != 0).unsqueeze(-1).float()
        return self.head((self.embedding(words) * mask).sum(1) / mask.sum(1).clamp(min=1))


class TextClassifier(LightningModule):
    def __init__(self, net: nn.Module | None = None, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.net = net or BagOfEmbeddings()
        self.lr = lr
        self.f1 = MulticlassF1Score(3, average="macro")

    def training_step(self, batch, batch_idx):
        words, y = batch
        loss = F.cross_entropy(self.net(words), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        words, y = batch
        self.f1.update(self.net(words), y)
        self.log("val_f1", self.f1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def shapes(count: int, seed: int, size: int = 16) -> TensorDataset:
    """Noisy images of a square, a disk or a cross of random size and place; the shape and the area it covers."""
    generator = torch.Generator().manual_seed(seed)
    kind = torch.randint(3, (count,), generator=generator)
    radius = torch.randint(3, size // 3 + 1, (count, 1, 1), generator=generator).float()
    centre = torch.randint(size // 3, size - size // 3, (count, 2, 1, 1), generator=generator).float()
    rows, columns = torch.meshgrid(torch.arange(size).float(), torch.arange(size).float(), indexing="ij")
    dy, dx = (rows - centre[:, 0]).abs(), (columns - centre[:, 1]).abs()
    square, disk = (dy <= radius) & (dx <= radius), dy**2 + dx**2 <= radius**2
    cross = ((dy <= radius) & (dx <= 1)) | ((dx <= radius) & (dy <= 1))
    image = torch.where(kind.view(-1, 1, 1) == 0, square, torch.where(kind.view(-1, 1, 1) == 1, disk, cross)).float()
    noisy = image + 0.2 * torch.randn(image.shape, generator=generator)
    return TensorDataset(noisy.unsqueeze(1), kind, image.mean((1, 2)))


class ShapesData(LightningDataModule):
    def __init__(self, batch_size: int = 32, image_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.image_size = image_size

    def setup(self, stage: str) -> None:
        self.train, self.val = shapes(768, 1, self.image_size), shapes(256, 2, self.image_size)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)


class ShapeNet(nn.Module):
    """Two convolutions and a global average: any image size. Returns the shape's logits and the area, as a tuple
    or (``named``) as a dict."""

    def __init__(self, width: int = 16, named: bool = False) -> None:
        super().__init__()
        self.named = named
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.shape, self.area = nn.Linear(width, 3), nn.Linear(width, 1)

    def forward(self, images: torch.Tensor):
        features = self.features(images)
        logits, area = self.shape(features), self.area(features).squeeze(-1)
        return {"shape": logits, "area": area} if self.named else (logits, area)


class TwoHeads(LightningModule):
    def __init__(self, net: nn.Module | None = None, lr: float = 3e-3, area_weight: float = 1.0) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.net = net or ShapeNet()
        self.lr, self.area_weight = lr, area_weight
        self.accuracy = MulticlassAccuracy(3)

    def _heads(self, images):
        out = self.net(images)
        return (out["shape"], out["area"]) if isinstance(out, dict) else out

    def training_step(self, batch, batch_idx):
        images, kind, area = batch
        logits, predicted = self._heads(images)
        loss = F.cross_entropy(logits, kind) + self.area_weight * F.mse_loss(predicted, area)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        images, kind, _ = batch
        self.accuracy.update(self._heads(images)[0], kind)
        self.log("val_acc", self.accuracy)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def curve(count: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(count, 4, generator=generator) * 4 - 2
    y = 2 * torch.sin(x[:, 0]) + x[:, 1] * x[:, 2] - x[:, 3] ** 2 + 0.1 * torch.randn(count, generator=generator)
    return TensorDataset(x, y)


class CurveData(LightningDataModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(curve(1024, 1), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(curve(512, 2), batch_size=self.batch_size)


class Regressor(LightningModule):
    def __init__(self, hidden: int = 64, learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )
        self.learning_rate = learning_rate
        self.r2 = R2Score()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.r2.update(self.net(x).squeeze(-1), y)
        self.log("val_r2", self.r2)

    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters(), lr=self.learning_rate)
