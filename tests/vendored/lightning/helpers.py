"""What the vendored Lightning tests import from Lightning's own test helpers, written here:
`RunIf` (Lightning's skip conditions, less the `deepspeed=True` requirement: infinity stands in)
and `ClassifDataModule` (a small classification data module; Lightning's draws its data with
scikit-learn, which only the CUDA tests use)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.testing import _runif_reasons
from torch.utils.data import DataLoader, TensorDataset


def RunIf(**kwargs):  # noqa: N802 - Lightning's name
    kwargs.pop("deepspeed", None)
    reasons, marker_kwargs = _runif_reasons(**kwargs)
    return pytest.mark.skipif(len(reasons) > 0, reason=f"Requires: [{' + '.join(reasons)}]", **marker_kwargs)


class ClassifDataModule(LightningDataModule):
    """Gaussian clusters, one a class: 32 features, 3 classes, 600 samples split 60/20/20."""

    def __init__(self, num_features: int = 32, length: int = 600, num_classes: int = 3, batch_size: int = 10):
        super().__init__()
        self.num_features, self.num_classes, self.batch_size = num_features, num_classes, batch_size
        generator = torch.Generator().manual_seed(0)
        labels = torch.arange(length) % num_classes
        centres = torch.randn(num_classes, num_features, generator=generator) * 2
        x = centres[labels] + torch.randn(length, num_features, generator=generator)
        cut1, cut2 = int(length * 0.6), int(length * 0.8)
        self._parts = {"train": (x[:cut1], labels[:cut1]), "valid": (x[cut1:cut2], labels[cut1:cut2]),
                       "test": (x[cut2:], labels[cut2:])}

    def _loader(self, part: str) -> DataLoader:
        return DataLoader(TensorDataset(*self._parts[part]), batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")
