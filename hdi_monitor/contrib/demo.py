"""A small character-level transformer language model, for the demo and the examples.

The text is the source of a few Python standard-library modules (it ships with every Python, so
the demo needs no download). The model is a causal ``nn.TransformerEncoder`` (so it exercises the
``nn.MultiheadAttention`` adapter) with learned positions and a tied read-out.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["CharDataModule", "CharLM", "run_demo", "stdlib_text"]

_MODULES = ("textwrap", "argparse", "string", "heapq", "bisect", "fractions", "calendar", "difflib")


def stdlib_text(max_chars: int = 400_000) -> str:
    """Source text of a few standard-library modules, ASCII only, at most ``max_chars`` characters."""
    import importlib

    parts = [inspect.getsource(importlib.import_module(name)) for name in _MODULES]
    text = "\n".join(parts).encode("ascii", "ignore").decode("ascii")
    return text[:max_chars]


class _Windows(Dataset):
    def __init__(self, data: Tensor, seq_len: int, num_samples: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(data) - seq_len - 1, (num_samples,), generator=g)
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        s = int(self.starts[i])
        chunk = self.data[s : s + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(pl.LightningDataModule):
    """Random windows of standard-library source text, encoded as bytes (vocabulary 128)."""

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 16,
        train_samples: int = 16_000,
        val_samples: int = 512,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len, self.batch_size = seq_len, batch_size
        self.train_samples, self.val_samples, self.seed = train_samples, val_samples, seed

    def setup(self, stage: str | None = None) -> None:
        data = torch.tensor(list(stdlib_text().encode("ascii")), dtype=torch.long)
        cut = int(0.9 * len(data))
        self.train = _Windows(data[:cut], self.seq_len, self.train_samples, self.seed)
        self.val = _Windows(data[cut:], self.seq_len, self.val_samples, self.seed + 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)


class CharLM(pl.LightningModule):
    """Causal character-level transformer: ``num_layers`` encoder layers of ``num_heads`` heads.

    Args:
        d_model: model width D.
        num_heads: attention heads per layer (head width ``d_model // num_heads``).
        num_layers: encoder layers.
        seq_len: maximum context length.
        lr: AdamW learning rate (0 keeps the weights fixed; the tests use that).
        vocab_size: byte vocabulary.
    """

    causal: Tensor  # (seq_len, seq_len) additive causal mask, a non-persistent buffer

    def __init__(
        self,
        d_model: int = 128,
        num_heads: int = 8,
        num_layers: int = 4,
        seq_len: int = 64,
        lr: float = 3e-3,
        vocab_size: int = 128,
    ) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, num_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        x = self.encoder(x, mask=self.causal[:t, :t], is_causal=True)
        return self.norm(x) @ self.embed.weight.T

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_bits_per_char", loss / math.log(2))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.01)


def run_demo(
    out_dir: str | Path = "runs",
    *,
    max_steps: int = 1200,
    every_n_steps: int = 25,
    log_images_every_n_steps: int = 200,
    d_model: int = 128,
    num_heads: int = 8,
    num_layers: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Train `CharLM` with `HDIMonitor` and a TensorBoard logger, and save the last checkpoint.

    Args:
        out_dir: TensorBoard root; the run goes to `<out_dir>/demo/version_<n>`.
        max_steps: optimizer steps.
        every_n_steps: measure every N optimizer steps.
        log_images_every_n_steps: heatmaps and angle histograms every N steps.
        d_model: model width D.
        num_heads: attention heads per layer.
        num_layers: encoder layers.
        seed: seed of `lightning.seed_everything`.
        progress: show the progress bar.

    Returns:
        The run's log directory. It holds the event files (`tensorboard --logdir <out_dir>`) and
        `checkpoints/last.ckpt`, which `hdi-monitor report <ckpt> --module hdi_monitor.contrib.demo.CharLM`
        reads.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    from hdi_monitor.integrations.lightning import HDIMonitor
    from hdi_monitor.monitor.detector import SaturationDetector

    pl.seed_everything(seed, verbose=False)
    torch.set_float32_matmul_precision("high")
    logger = TensorBoardLogger(str(out_dir), name="demo")
    monitor = HDIMonitor(
        every_n_steps=every_n_steps,
        log_images_every_n_steps=log_images_every_n_steps,
        detector=SaturationDetector(warmup_steps=max_steps // 3),
    )
    trainer = pl.Trainer(
        max_steps=max_steps,
        logger=logger,
        # only ``<log_dir>/checkpoints/last.ckpt``, the input of ``hdi-monitor report ... --module``
        callbacks=[monitor, ModelCheckpoint(save_last=True, save_top_k=0)],
        log_every_n_steps=10,
        val_check_interval=200,
        limit_val_batches=8,
        enable_progress_bar=progress,
        enable_model_summary=False,
        accelerator="auto",
        devices=1,
    )
    model = CharLM(d_model=d_model, num_heads=num_heads, num_layers=num_layers)
    trainer.fit(model, datamodule=CharDataModule())
    return Path(logger.log_dir)
