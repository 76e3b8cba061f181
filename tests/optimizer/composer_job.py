"""Composer's Trainer, run by ``test_savers.py`` in its own process: 6 batches without stopping, and
3 batches, a checkpoint, and a second Trainer that resumes from it to batch 6.

``python -m tests.optimizer.composer_job OUT ACC`` writes ``OUT/outcome.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

try:
    import torchvision  # noqa: F401
except (ImportError, RuntimeError):
    # torchvision from PyPI is a CUDA build: beside a CPU build of torch its kernels do not load and
    # its import fails on two fake-kernel registrations.  Composer imports it; this run uses none of it.
    for name in list(sys.modules):
        if name.startswith("torchvision"):
            del sys.modules[name]
    _TORCHVISION = torch.library.Library("torchvision", "DEF")
    for _op in ("nms", "qnms"):
        _TORCHVISION.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

from composer import Trainer
from composer.models import ComposerModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clipopt import ClippedOptimizer, ZClip

from .test_savers import outcome


class Net(ComposerModel):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, batch: Any) -> torch.Tensor:
        return self.net(batch[0])

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, batch[1])


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g))
    return DataLoader(data, batch_size=4, shuffle=False)


def run(acc: int, max_duration: str, save_folder: Path | None = None, load_path: Path | None = None) -> Any:
    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = ClippedOptimizer(inner, max_norm=ZClip(warmup_steps=2), accumulation_steps=acc)
    trainer = Trainer(
        model=model,
        train_dataloader=_data(),
        optimizers=opt,
        max_duration=max_duration,
        device="cpu",
        save_folder=None if save_folder is None else str(save_folder),
        save_interval="3ba",
        load_path=None if load_path is None else str(load_path),
        progress_bar=False,
        log_to_console=False,
        seed=0,
    )
    trainer.fit()
    return outcome(model, opt)


def main(out: Path, acc: int) -> None:
    uninterrupted = run(acc, "6ba")
    run(acc, "3ba", save_folder=out / "ckpt")
    resumed = run(acc, "6ba", load_path=out / "ckpt" / "ep0-ba3-rank0.pt")
    torch.save({"uninterrupted": uninterrupted, "resumed": resumed}, out / "outcome.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
