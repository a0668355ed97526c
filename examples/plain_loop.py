"""Head-diversity monitoring in a hand-written PyTorch training loop (no Lightning, no Trainer).

A small causal character-level transformer learns the source of a few standard-library modules
(bytes as tokens, so nothing is downloaded). ``HDITracker`` measures every ``--every`` optimizer
steps and writes to the same ``SummaryWriter`` as the loop's own loss, on the same step axis::

    python examples/plain_loop.py --out runs/plain --steps 300
    tensorboard --logdir runs/plain          # Scalars: loss and hdi/*; Custom Scalars: HDI charts

The pattern is three lines around an ordinary loop::

    with tracker.capture(batch):      # head outputs of this forward pass, if this step is measured
        loss = ...                    # forward
    loss.backward()
    tracker.step()                    # write the measurement, next step
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.tensorboard import SummaryWriter

from hdi_monitor import HDITracker
from hdi_monitor.contrib.demo import stdlib_text


class TinyLM(nn.Module):
    """Causal ``nn.TransformerEncoder`` over bytes, with learned positions and a tied read-out."""

    causal: Tensor  # a buffer: the (seq_len, seq_len) causal mask

    def __init__(
        self, d_model: int = 64, num_heads: int = 4, num_layers: int = 2, seq_len: int = 64, vocab: int = 128
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, num_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        x = self.encoder(self.embed(tokens) + self.pos[:t], mask=self.causal[:t, :t], is_causal=True)
        return self.norm(x) @ self.embed.weight.T


def train(
    out_dir: str | Path = "runs/plain",
    *,
    steps: int = 300,
    every: int = 20,
    images_every: int = 100,
    d_model: int = 64,
    num_heads: int = 4,
    num_layers: int = 2,
    seq_len: int = 64,
    batch_size: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
) -> HDITracker:
    """Train `TinyLM` for ``steps`` optimizer steps; returns the tracker (its ``history``)."""
    torch.manual_seed(seed)
    data = torch.tensor(list(stdlib_text(200_000).encode("ascii")), dtype=torch.long)
    model = TinyLM(d_model, num_heads, num_layers, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    writer = SummaryWriter(str(out_dir))
    tracker = HDITracker(model, every_n_steps=every, log_images_every_n_steps=images_every, writer=writer)
    try:
        for _ in range(steps):
            starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,))
            chunk = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
            x, y = chunk[:, :-1], chunk[:, 1:]
            with tracker.capture(x):
                logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            writer.add_scalar("loss", loss.item(), tracker.current_step)  # same x as the HDI points
            tracker.step()  # finish the measured step (W_O was read in the forward pass), next step
            optimizer.step()
            optimizer.zero_grad()
    finally:
        tracker.close()
        writer.close()
    return tracker


def main(argv: Sequence[str] | None = None) -> HDITracker:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/plain")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--images-every", type=int, default=100)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    tracker = train(
        args.out,
        steps=args.steps,
        every=args.every,
        images_every=args.images_every,
        d_model=args.d_model,
        num_heads=args.heads,
        num_layers=args.layers,
    )
    last = tracker.history[-1]
    print(
        f"{len(tracker.history)} measurements; last (step {last['step']:.0f}): mean key HDI {last.get('hdi/key/mean', float('nan')):.3f}"
    )
    print(f"tensorboard --logdir {args.out}")
    return tracker


if __name__ == "__main__":
    main()
