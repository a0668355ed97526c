"""HDITrainerCallback under the Hugging Face Trainer with DeepSpeed ZeRO-3, on CPU (gloo): a script for
``tests/distributed/test_tensor_parallel_zero3.py``.

Run it as a script (it starts its own 2 ranks; the tests call `scenario` on the ranks of a persistent gloo
group instead)::

    DS_ACCELERATOR=cpu python tests/scripts/hf_zero3.py --out DIR

The tiny Llama of `tp_engines.build_llama` trains one optimizer step on the 4 samples of `samples`
(2 per rank, so the step's global batch is all of them, whatever order the Trainer's sampler picks).
The CPU recipe: ``ACCELERATE_USE_DEEPSPEED=true``, ``PartialState(backend="gloo")`` made before the
Trainer, and ``accelerator_config={"use_configured_state": True}``. Each rank writes ``rank{R}.json``:
the callback's measurement (HDI, covariance, effective heads, token counts) and the parameter shapes
outside the forward pass (``[0]`` when ZeRO-3 partitioned them).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import tp_engines as te  # noqa: E402

SAMPLES, SEQ = 4, 8


def samples() -> torch.Tensor:
    """``(SAMPLES, SEQ)`` token ids."""
    return torch.randint(0, te.LLAMA_KW["vocab_size"], (SAMPLES, SEQ), generator=torch.Generator().manual_seed(5))


def scenario(out: str) -> None:
    """Train and write this rank's ``rank{R}.json``: on the script's own ranks (`_worker`) or on the ranks of
    an initialised gloo group whose environment names them (the tests' persistent pool)."""
    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from accelerate import PartialState
    from transformers import Trainer, TrainingArguments

    from hdi_monitor import HDITrainerCallback

    te.deepspeed_without_op_builds()  # no C++ op is compiled (see there)
    PartialState(backend="gloo")
    ds_config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_allow_untested_optimizer": True,
    }
    args = TrainingArguments(
        output_dir=str(Path(out) / "trainer"),
        per_device_train_batch_size=SAMPLES // 2,
        max_steps=1,
        learning_rate=1e-3,
        deepspeed=ds_config,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        accelerator_config={"use_configured_state": True},
        ddp_backend="gloo",
    )
    data = [{"input_ids": x, "labels": x} for x in samples()]
    callback = HDITrainerCallback(
        every_n_steps=1,
        log_images_every_n_steps=0,
        max_tokens=None,
        detector=None,
        strict=True,
        log_dir=str(Path(out) / "tb"),
    )
    trainer = Trainer(model=te.build_llama(), args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    m = callback.last_measurement
    assert m is not None
    result: dict[str, Any] = {
        "step": m.step,
        "layers": {
            lay.name: {
                "hdi": dict(lay.hdi),
                "effective_heads": lay.effective_heads,
                "num_tokens": lay.num_tokens,
                "covariance": None if lay.covariance is None else lay.covariance.tolist(),
            }
            for lay in m.report.layers
        },
        "q_shape": list(trainer.model.model.layers[0].self_attn.q_proj.weight.shape),
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
    }
    (Path(out) / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))


def _worker(rank: int, out: str, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    scenario(out)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # no rank tears gloo down while another is still finishing a collective
        from gloo_exit import exit_after_barrier  # this script's folder is sys.path[0], also in spawned workers

        exit_after_barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_worker, args=(args.out, port), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
