"""HDIMonitor under Lightning's ``ModelParallelStrategy`` with tensor parallelism, on CPU (gloo): a script for
``tests/distributed/test_tensor_parallel_zero3.py``.

Run it as a script, never inside pytest (Lightning re-runs the command that started it in each rank)::

    python tests/scripts/tp_lightning.py --out DIR [--dp 2] [--no-monitor]

``data_parallel_size=dp, tensor_parallel_size=2`` (2 or 4 ranks): ``configure_model`` shards the attention of
`tp_engines.PlainLM` with ColwiseParallel q/k/v and RowwiseParallel o, then ``n_heads //= tp`` (Lightning's
own TP example does the same), and with ``--dp 2`` every block and the root with FSDP2 ``fully_shard`` on the
``data_parallel`` mesh dimension. Data-parallel rank ``r`` trains on samples ``r, r + dp, ...`` of each global
batch of `tp_engines.global_batches` (TP ranks see the same tokens). Each rank writes ``rank{R}.json``: the monitor's measurement of every step
(HDI, covariance, effective heads, token counts), the losses and the final full weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).parent))
import tp_engines as te  # noqa: E402


def run(out: Path, monitor_on: bool, dp: int) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    from hdi_monitor import HDIMonitor

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = te.build_plain()
            self.losses: list[float] = []

        def configure_model(self) -> None:
            te.apply_plain_tp(self.lm, self.device_mesh["tensor_parallel"])
            if dp > 1:
                from torch.distributed.fsdp import fully_shard

                for block in self.lm.layers:
                    fully_shard(block, mesh=self.device_mesh["data_parallel"])
                fully_shard(self, mesh=self.device_mesh["data_parallel"])

        def train_dataloader(self) -> Any:
            rank = self.device_mesh["data_parallel"].get_local_rank() if dp > 1 else 0
            return DataLoader([b[rank::dp] for b in batches], batch_size=None)

        def forward(self, tokens: Tensor) -> Tensor:
            return self.lm(tokens)

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            logits = self(batch)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    batches = list(te.global_batches())
    callbacks: list[Any] = []
    monitor = None
    if monitor_on:
        monitor = HDIMonitor(every_n_steps=1, log_images_every_n_steps=0, max_tokens=None, detector=None, strict=True)
        callbacks.append(monitor)
    measured: dict[int, dict[str, Any]] = {}

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            m = monitor.last_measurement if monitor is not None else None
            if m is not None and m.step not in measured:
                measured[m.step] = {
                    lay.name: {
                        "hdi": dict(lay.hdi),
                        "effective_heads": lay.effective_heads,
                        "num_tokens": lay.num_tokens,
                        "covariance": None if lay.covariance is None else lay.covariance.tolist(),
                    }
                    for lay in m.report.layers
                }

    model = LM()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 * dp,
        strategy=ModelParallelStrategy(
            data_parallel_size=dp,
            tensor_parallel_size=2,
            process_group_backend="gloo",
            timeout=timedelta(seconds=60),
        ),
        max_steps=len(batches),
        # the monitor's scalars go to the logger, which writes on rank 0 only (checked by the test)
        logger=CSVLogger(str(out / "logs"), name="tp") if monitor_on else False,
        callbacks=[*callbacks, Keep()],
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    layer_names = [lay.name for lay in monitor.tracker.layers] if monitor is not None and monitor.tracker else []
    result = {
        "steps": [measured[s] for s in sorted(measured)],
        "layer_names": layer_names,
        "losses": model.losses,
        "weights": {n: te._full(p).tolist() for n, p in model.lm.named_parameters()},
        "mesh_dim_names": list(trainer.strategy.device_mesh.mesh_dim_names),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-monitor", action="store_true")
    parser.add_argument("--dp", type=int, default=1, choices=(1, 2))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    run(out, not args.no_monitor, args.dp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
