"""A user's text classifier: short reviews, negative, neutral or positive, of 3 to 24 words.

Written as NLP tutorials write it: the DataModule builds its own word-level vocabulary in ``setup`` from the training
split only, and keeps it in ``state_dict`` / ``load_state_dict`` (so the checkpoint carries it); a ``collate_fn``
turns words into ids with it and pads each batch to its longest review; the model embeds the words, averages them
over the words that are not padding, and classifies; macro F1 from torchmetrics. ``predict_step`` returns the label
of each review as a string. Used from YAML (``tests/user_code/text.yaml``) by ``class_path``.
"""

import random
from collections import Counter
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassF1Score

from template.engine import fold_indices

LABELS = ("negative", "neutral", "positive")
PAD, UNKNOWN = "<pad>", "<unk>"
FILLER = (
    "the", "a", "this", "that", "it", "was", "is", "and", "but", "so", "very", "really", "quite", "i", "we", "they",
    "my", "our", "film", "book", "place", "food", "service", "time", "staff", "price", "room", "story", "plot",
    "ending", "start", "day", "night", "again", "ever", "just", "also", "only", "still",
)  # fmt: skip
CUES = {
    "negative": (
        "awful", "bad", "boring", "terrible", "rude", "dirty", "slow", "bland", "broken", "worst", "waste",
        "disappointing",
    ),
    "neutral": (
        "okay", "average", "fine", "decent", "ordinary", "standard", "usual", "plain", "acceptable", "moderate",
        "typical", "fair",
    ),
    "positive": (
        "great", "lovely", "superb", "friendly", "tasty", "brilliant", "clean", "quick", "delightful", "best",
        "wonderful", "excellent",
    ),
}  # fmt: skip


def write_reviews(samples: int, seed: int) -> list[tuple[str, int]]:
    """``samples`` reviews and their labels: mostly filler words, a few cue words of their class."""
    rng = random.Random(seed)
    reviews = []
    for _ in range(samples):
        label = rng.randrange(len(LABELS))
        words = [
            rng.choice(CUES[LABELS[label]]) if rng.random() < 0.25 else rng.choice(FILLER)
            for _ in range(rng.randint(3, 24))
        ]
        reviews.append((" ".join(words), label))
    return reviews


class Reviews(LightningDataModule):
    """Reviews split 80/20 into training and validation, plus a test set of their own; the vocabulary is the
    training split's words seen at least ``min_count`` times, at most ``max_vocab`` of them."""

    num_classes = len(LABELS)

    def __init__(
        self,
        samples: int = 900,
        batch_size: int = 32,
        max_vocab: int = 200,
        min_count: int = 2,
        num_workers: int = 0,
        fold: int | None = None,
        num_folds: int = 5,
    ) -> None:
        super().__init__()
        self.samples, self.batch_size, self.num_workers = samples, batch_size, num_workers
        self.max_vocab, self.min_count = max_vocab, min_count
        self.fold, self.num_folds = fold, num_folds
        self.vocab: dict[str, int] | None = None

    def setup(self, stage: str) -> None:
        reviews = write_reviews(self.samples, seed=3)
        cut = int(0.8 * len(reviews))
        if self.fold is None:
            self.train, self.val = reviews[:cut], reviews[cut:]
        else:
            labels = torch.tensor([label for _, label in reviews])
            train, val = fold_indices(self.fold, self.num_folds, len(reviews), labels)
            self.train, self.val = [reviews[i] for i in train], [reviews[i] for i in val]
        self.test = write_reviews(200, seed=4)
        if self.vocab is None:  # a checkpoint's vocabulary (load_state_dict) stays
            counts = Counter(word for text, _ in self.train for word in text.split())
            kept = [word for word, n in counts.most_common(self.max_vocab - 2) if n >= self.min_count]
            self.vocab = {word: i for i, word in enumerate([PAD, UNKNOWN, *kept])}

    def state_dict(self) -> dict[str, Any]:
        return {"vocab": self.vocab}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.vocab = state_dict["vocab"]

    def collate(self, batch: list[tuple[str, int]]) -> tuple[Tensor, Tensor]:
        """Word ids padded to the longest review of the batch, and the labels."""
        ids = [torch.tensor([self.vocab.get(w, self.vocab[UNKNOWN]) for w in text.split()]) for text, _ in batch]
        padded = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=self.vocab[PAD])
        return padded, torch.tensor([label for _, label in batch])

    def _loader(self, reviews: list, shuffle: bool = False) -> DataLoader:
        return DataLoader(
            reviews, batch_size=self.batch_size, shuffle=shuffle, collate_fn=self.collate, num_workers=self.num_workers
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test)


class MeanOfEmbeddings(nn.Module):
    """Word embeddings averaged over the words that are not padding (id 0), then a small MLP."""

    def __init__(self, vocab_size: int, dim: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, classes))

    def forward(self, tokens: Tensor) -> Tensor:
        mask = (tokens != 0).unsqueeze(-1).float()
        pooled = (self.embed(tokens) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.head(pooled)


class ReviewClassifier(LightningModule):
    """Cross-entropy on the labels; macro F1 on validation and test."""

    def __init__(self, vocab_size: int = 200, dim: int = 32, num_classes: int = 3, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = MeanOfEmbeddings(vocab_size, dim, num_classes)
        self.val_f1 = MulticlassF1Score(num_classes, average="macro")
        self.test_f1 = MulticlassF1Score(num_classes, average="macro")

    def forward(self, tokens: Tensor) -> Tensor:
        return self.encoder(tokens)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = F.cross_entropy(self(tokens), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self(tokens)
        self.val_f1(logits, labels)
        self.log("val_loss", F.cross_entropy(logits, labels))
        self.log("val_f1", self.val_f1, prog_bar=True)

    def test_step(self, batch, batch_idx):
        tokens, labels = batch
        self.test_f1(self(tokens), labels)
        self.log("test_f1", self.test_f1)

    def predict_step(self, batch, batch_idx):
        return [LABELS[i] for i in self(batch[0]).argmax(-1).tolist()]

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
