"""Head diversity of a model sharded by tensor parallelism or DeepSpeed ZeRO-3, on CPU (gloo): a script for
``tests/distributed/test_tensor_parallel_zero3.py``.

Run it as a script (it starts its own ranks with ``torch.multiprocessing``; the tests call `scenario` on the
ranks of a persistent gloo group instead)::

    python tests/scripts/tp_engines.py --engine plain_tp --out DIR   # DTensor TP, num_heads //= tp
    python tests/scripts/tp_engines.py --engine hf_tp    --out DIR   # transformers tp_plan="auto" (tiny Llama)
    python tests/scripts/tp_engines.py --engine zero3    --out DIR   # deepspeed.initialize, ZeRO stage 3
    python tests/scripts/tp_engines.py --engine tp_beside_dp --out DIR  # a hand-made DP group beside a 1-D TP mesh

Every engine builds the model from a seed, so the test rebuilds the same unsharded weights in its own process
(`build_plain`, `build_llama`) and compares. Each rank writes ``rank{R}.json``: the measured layers, their
head counts and notes, the HDI of each projection (``head_diversity`` of the sharded model; every rank
takes part in every gather), what was refused and why, and, for ``plain_tp``, the layers of two variants
that must be refused (no ``head_dim``, and a count that fits neither reading).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn

WORLD_SIZE = 2
PROJECTIONS = ("query", "key", "value", "output")
PLAIN_KW = {"vocab": 64, "dim": 32, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2}
LLAMA_KW = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


class Attention(nn.Module):
    """Meta-reference attention (wq/wk/wv/wo, grouped-query), as the PyTorch TP tutorial shards it."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, *, with_head_dim: bool = True) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        if with_head_dim:
            self.head_dim = dim // n_heads
        self._d = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self._d, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self._d, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self._d, bias=False)
        self.wo = nn.Linear(n_heads * self._d, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self._d).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self._d).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self._d).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, **kw: Any) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads, **kw)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm(x))
        return x + self.mlp(x)


class PlainLM(nn.Module):
    """A small causal LM of `Block` layers."""

    def __init__(self, vocab: int, dim: int, n_heads: int, n_kv_heads: int, n_layers: int, **kw: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, **kw) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_plain(seed: int = 0, **kw: Any) -> PlainLM:
    """The plain model every ``plain_tp`` / ``zero3`` run shards (same weights for the same seed)."""
    torch.manual_seed(seed)
    return PlainLM(**PLAIN_KW, **kw)


def build_llama(seed: int = 0) -> nn.Module:
    """A tiny ``LlamaForCausalLM`` from a config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA_KW, attn_implementation="sdpa"))


def apply_plain_tp(model: PlainLM, mesh: Any) -> None:
    """ColwiseParallel q/k/v, RowwiseParallel o, then ``n_heads //= tp`` (the PyTorch TP tutorial's recipe)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    for block in model.layers:
        plan = {f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}
        plan["attention.wo"] = RowwiseParallel()
        parallelize_module(block, mesh, plan)
        block.attention.n_heads //= tp
        block.attention.n_kv_heads //= tp


class FusedAttention(nn.Module):
    """nanoGPT-style attention: one ``c_attn`` with ``[q | k | v]`` rows, ``c_proj``, ``n_head`` (weights only)."""

    def __init__(self, dim: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, dim // n_head
        self.c_attn = nn.Linear(dim, 3 * dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)


def build_fused(seed: int = 0) -> nn.Module:
    """Two `FusedAttention` layers (same weights for the same seed)."""
    torch.manual_seed(seed)
    return nn.ModuleDict({"plain": FusedAttention(), "strided": FusedAttention()})


def _fused_tp(mesh: Any) -> dict[str, Any]:
    """``c_attn`` split by rows two ways: plain ``Shard(0)`` (each rank a block of ``[q|k|v]``: must be
    refused) and ``_StridedShard(0, split_factor=3)`` (transformers ``packed_colwise``: each rank its
    share of q, of k and of v; must read right); ``c_proj`` ``Shard(1)`` in both."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from hdi_monitor import head_diversity
    from hdi_monitor.models import discover_attention

    model = build_fused()
    for key, placement in (("plain", Shard(0)), ("strided", _StridedShard(0, split_factor=3))):
        mod = model[key]
        mod.c_attn.weight = nn.Parameter(distribute_tensor(mod.c_attn.weight.detach(), mesh, [placement]))
        mod.c_proj.weight = nn.Parameter(distribute_tensor(mod.c_proj.weight.detach(), mesh, [Shard(1)]))
    found = discover_attention(model)
    report = head_diversity(model)
    from hdi_monitor.models import AttentionSpec

    spec = AttentionSpec(modules=r"^plain$", qkv="c_attn", qkv_layout="contiguous", output="c_proj", head_dim=8)
    try:
        discover_attention(model, spec=spec)
        spec_error = ""
    except ValueError as err:
        spec_error = str(err)
    return {
        "skipped": {s.name: s.reason for s in found.skipped},
        "hdi": {r.name: dict(r.hdi) for r in report.layers},
        "spec_error": spec_error,
    }


def _report(model: nn.Module) -> dict[str, Any]:
    from hdi_monitor import head_diversity
    from hdi_monitor.models import discover_attention

    found = discover_attention(model)
    out: dict[str, Any] = {
        "skipped": {s.name: s.reason for s in found.skipped},
        "layers": {
            lay.name: {
                "num_heads": lay.num_heads,
                "num_kv_heads": lay.num_kv_heads,
                "head_dim": lay.head_dim,
                "notes": list(lay.notes),
                "tp": None if lay.tensor_parallel is None else lay.tensor_parallel.size,
            }
            for lay in found.layers
        },
    }
    report = head_diversity(model)
    out["hdi"] = {
        r.name: {p: (None if r.hdi.get(p) is None or math.isnan(r.hdi[p]) else r.hdi[p]) for p in PROJECTIONS}
        for r in report.layers
    }
    return out


def _refusals(mesh: Any) -> dict[str, str]:
    """Two TP variants whose head counts cannot be decided: discovery must refuse them, naming each layer."""
    from hdi_monitor.models import discover_attention

    found: dict[str, str] = {}
    no_dim = build_plain(with_head_dim=False)
    apply_plain_tp(no_dim, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            d = discover_attention(no_dim)
            found.update({f"no_head_dim:{s.name}": s.reason for s in d.skipped})
        except ValueError as err:
            found["no_head_dim"] = str(err)
        odd = build_plain()
        apply_plain_tp(odd, mesh)
        odd.layers[1].attention.n_heads = 3  # fits neither 4 (global) nor 2 (local)
        d = discover_attention(odd)
        found.update({f"odd:{s.name}": s.reason for s in d.skipped})
    return found


def _mesh_names_cases() -> dict[str, Any]:
    """The same TP split on an unnamed mesh (told by the out-projection's Shard(1)) and on a mesh whose
    dimension is named data-parallel (a contradiction: refused)."""
    from torch.distributed.device_mesh import init_device_mesh

    from hdi_monitor.models import discover_attention

    out: dict[str, Any] = {}
    unnamed = build_plain()
    apply_plain_tp(unnamed, init_device_mesh("cpu", (WORLD_SIZE,)))
    found = discover_attention(unnamed)
    out["unnamed"] = [(lay.num_heads, lay.head_dim, lay.tensor_parallel.size if lay.tensor_parallel else None)
                      for lay in found.layers]  # fmt: skip
    named_dp = build_plain()
    apply_plain_tp(named_dp, init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            discover_attention(named_dp)
            out["named_dp"] = ""
        except ValueError as err:
            out["named_dp"] = str(err)
    return out


def _run_plain_tp(out: Path, rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    model = build_plain()
    apply_plain_tp(model, mesh)
    result = _report(model)
    result["refused"] = _refusals(mesh)
    result["fused"] = _fused_tp(mesh)
    result["meshes"] = _mesh_names_cases()
    tokens = torch.randint(0, PLAIN_KW["vocab"], (2, 8), generator=torch.Generator().manual_seed(3))
    result["logits_sum"] = float(model(tokens).sum())  # the sharded model still runs
    return result


def hf_tokens() -> Tensor:
    """``(2, 8)`` token ids for the tiny Llama."""
    return torch.randint(0, LLAMA_KW["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(4))


def _run_hf_tp(out: Path, rank: int) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    from hdi_monitor import head_diversity

    folder = out / "llama"
    if rank == 0:
        build_llama().save_pretrained(folder)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32)
    w = model.model.layers[0].self_attn.q_proj.weight
    result = _report(model)
    stats = head_diversity(model, inputs={"input_ids": hf_tokens()})  # o_proj sees this rank's heads
    result["activations"] = {
        r.name: {
            "effective_heads": r.effective_heads,
            "num_tokens": r.num_tokens,
            "covariance": None if r.covariance is None else r.covariance.tolist(),
        }
        for r in stats.layers
    }
    result["q_placements"] = [str(p) for p in w.placements]
    result["mesh_dim_names"] = list(w.device_mesh.mesh_dim_names or ())
    return result


def deepspeed_without_op_builds() -> Any:
    """``deepspeed``, with every C++ op marked unavailable so that nothing is compiled.

    On the CPU accelerator ``deepspeed.comm`` JIT-builds its shared-memory all-reduce (``deepspeed_shm_comm``,
    a C++ extension) at the first ``init_distributed``, after probing every op with compiler runs. Without it
    DeepSpeed's collectives are torch.distributed's (gloo here); the optimizers are torch's, so no other op is
    asked for, and ZeRO-3 partitions and gathers the parameters as before.
    """
    import deepspeed
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)
    return deepspeed


def _run_zero3(out: Path, rank: int) -> dict[str, Any]:
    deepspeed = deepspeed_without_op_builds()

    model = build_plain()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    shapes = [list(p.shape) for p in engine.module.layers[0].attention.wq.parameters()]
    result = _report(engine.module)
    result["partitioned_shapes"] = shapes
    return result


# ------------------------------------------------------------------ training with the tracker (activations)

TRACK_STEPS, GLOBAL_BATCH, SEQ = 3, 4, 8


def global_batches(seed: int = 1) -> Tensor:
    """``(TRACK_STEPS, GLOBAL_BATCH, SEQ)`` token ids, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, PLAIN_KW["vocab"], (TRACK_STEPS, GLOBAL_BATCH, SEQ), generator=g)


def _full(t: Tensor) -> Tensor:
    t = t.detach()
    return t.full_tensor() if callable(getattr(t, "full_tensor", None)) else t


def train_step(forward: Any, tokens: Tensor, tracker: Any, engine: Any, optimizer: Any) -> tuple[Tensor, Any]:
    """One training step (forward under ``tracker.capture`` when there is a tracker, backward, the
    tracker's ``step()`` before the optimizer's); returns the loss and the measurement (or None)."""
    if tracker is not None:
        with tracker.capture(tokens):
            logits = forward(tokens)
    else:
        logits = forward(tokens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    if engine is not None:
        engine.backward(loss)
    else:
        loss.backward()
    m = tracker.step() if tracker is not None else None
    if engine is not None:
        engine.step()
    else:
        optimizer.step()
        optimizer.zero_grad()
    return loss, m


def track(
    model: nn.Module,
    dp_rank: int,
    dp: int,
    *,
    monitor: bool = True,
    lr: float = 0.05,
    engine: Any = None,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """Train ``model`` TRACK_STEPS steps on this data-parallel rank's share of each global batch (with an
    `HDITracker` measuring every step, or without), return each step's loss and measurement and the
    final weights. With a DeepSpeed ``engine`` (whose module is ``model``), the engine runs the forward,
    backward and optimizer steps."""
    from hdi_monitor import HDITracker
    from hdi_monitor.monitor.sinks import MemorySink

    tracker = None
    if monitor:
        tracker = HDITracker(
            model,
            every_n_steps=1,
            projections=PROJECTIONS,
            max_tokens=max_tokens,
            log_images_every_n_steps=0,
            sinks=[MemorySink()],
            strict=True,
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr) if engine is None else None
    forward = engine if engine is not None else model
    losses, steps = [], []
    for tokens in global_batches():
        local = tokens[dp_rank::dp]
        loss, m = train_step(forward, local, tracker, engine, optimizer)
        if tracker is not None:
            assert m is not None
            steps.append(
                {
                    lay.name: {
                        "hdi": dict(lay.hdi),
                        "effective_heads": lay.effective_heads,
                        "num_tokens": lay.num_tokens,
                        "covariance": None if lay.covariance is None else lay.covariance.tolist(),
                    }
                    for lay in m.report.layers
                }
            )
        losses.append(float(loss.detach()))
    if engine is not None:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            weights = {n: p.detach().clone().tolist() for n, p in model.named_parameters()}
    else:
        weights = {n: _full(p).tolist() for n, p in model.named_parameters()}
    return {"losses": losses, "steps": steps, "weights": weights}


def _run_plain_tp_track(out: Path, rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    runs = {}
    for monitor in (True, False):
        model = build_plain()
        apply_plain_tp(model, mesh)
        runs["with" if monitor else "without"] = track(model, 0, 1, monitor=monitor)
    return runs


#: A token budget well below the tokens of one global batch (GLOBAL_BATCH * SEQ).
SUBSAMPLE = 12


def _run_plain_tp_subsample(out: Path, rank: int) -> dict[str, Any]:
    """Plain TP with ``max_tokens`` below the batch: every TP rank picks the same tokens of its share
    before the gather, so each head-output gather moves at most ``max_tokens`` rows, and the result
    equals one process drawing from the same seeded generator over the same tokens."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    model = build_plain()
    apply_plain_tp(model, mesh)
    gathered: list[int] = []
    all_gather = dist.all_gather

    def counting_all_gather(parts: Any, tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        gathered.append(tensor.shape[0] if tensor.ndim == 2 else -1)  # head-output rows (2-D) per call
        return all_gather(parts, tensor, *args, **kwargs)

    dist.all_gather = counting_all_gather  # the script's own process: a probe of what is sent
    try:
        run = track(model, 0, 1, max_tokens=SUBSAMPLE)
    finally:
        dist.all_gather = all_gather
    run["gathered_rows"] = [n for n in gathered if n >= 0]
    return run


def _run_fsdp_tp_track(out: Path, rank: int) -> dict[str, Any]:
    """A 2 x 2 ("dp", "tp") mesh: TP inside each block, FSDP2 over "dp" (weights are 2-D DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    runs = {}
    for monitor in (True, False):
        model = build_plain()
        apply_plain_tp(model, mesh["tp"])
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        runs["with" if monitor else "without"] = track(model, mesh.get_coordinate()[0], 2, monitor=monitor)
    runs["placements"] = [str(p) for p in model.layers[0].attention.wo.weight.placements]
    return runs


def _run_zero3_track(out: Path, rank: int) -> dict[str, Any]:
    """ZeRO-3 data parallel over 2 ranks: each trains on half of each global batch."""
    deepspeed = deepspeed_without_op_builds()

    runs: dict[str, Any] = {}
    for monitor in (True, False):
        model = build_plain()
        config = {
            "train_micro_batch_size_per_gpu": GLOBAL_BATCH // WORLD_SIZE,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
            "zero_allow_untested_optimizer": True,
        }
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        runs["with" if monitor else "without"] = track(engine.module, rank, WORLD_SIZE, monitor=monitor, engine=engine)
    return runs


# ----------------------------------------------------------------------------- cost of a measured step

TIME_KW = {"vocab": 256, "dim": 256, "n_heads": 8, "n_kv_heads": 8, "n_layers": 4}
TIME_BATCH, TIME_SEQ, TIME_STEPS = 8, 128, 11


def _time_steps(model: nn.Module, dp_rank: int, dp: int, *, monitor: bool, engine: Any = None) -> list[float]:
    """Wall time of each training step (forward, backward, optimizer; with the tracker measuring every
    step when ``monitor``), synchronised over the ranks."""
    import time

    from hdi_monitor import HDITracker
    from hdi_monitor.monitor.sinks import MemorySink

    tracker = None
    if monitor:
        tracker = HDITracker(
            model, every_n_steps=1, projections=PROJECTIONS, max_tokens=None, log_images_every_n_steps=0,
            sinks=[MemorySink()], strict=True,
        )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3) if engine is None else None
    forward = engine if engine is not None else model
    g = torch.Generator().manual_seed(7)
    times = []
    for _ in range(TIME_STEPS):
        tokens = torch.randint(0, TIME_KW["vocab"], (TIME_BATCH, TIME_SEQ), generator=g)[dp_rank::dp]
        dist.barrier()
        start = time.perf_counter()
        train_step(forward, tokens, tracker, engine, optimizer)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def _run_tp_time(out: Path, rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    result = {}
    for monitor in (False, True):
        torch.manual_seed(0)
        model = PlainLM(**TIME_KW)
        apply_plain_tp(model, mesh)
        result["measured" if monitor else "plain"] = _time_steps(model, 0, 1, monitor=monitor)
    return result


def _run_zero3_time(out: Path, rank: int) -> dict[str, Any]:
    deepspeed = deepspeed_without_op_builds()

    result = {}
    for monitor in (False, True):
        torch.manual_seed(0)
        model = PlainLM(**TIME_KW)
        config = {
            "train_micro_batch_size_per_gpu": TIME_BATCH // WORLD_SIZE,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
            "zero_allow_untested_optimizer": True,
        }
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        key = "measured" if monitor else "plain"
        result[key] = _time_steps(engine.module, rank, WORLD_SIZE, monitor=monitor, engine=engine)
    return result


def _run_stage_mismatch(out: Path, rank: int) -> dict[str, Any]:
    """Pipeline-parallel-like: rank r holds only block r. The monitor refuses at setup, on every rank,
    with a message naming the layers that differ (weights only as well: only rank 0 logs, so the
    other stages' layers would never be seen); the refusal comes before any training step."""
    from hdi_monitor import HDITracker

    model = build_plain()
    # a stage keeps its blocks' qualified names (torchtitan's and torch.distributed.pipelining's split do)
    stage = nn.ModuleDict({"layers": nn.ModuleDict({str(rank): model.layers[rank]})})
    errors = {}
    for activations in (True, False):
        tracker = HDITracker(stage, every_n_steps=1, projections=PROJECTIONS, activations=activations, strict=True)
        try:
            tracker.setup()
            errors[str(activations)] = ""
        except ValueError as err:
            errors[str(activations)] = str(err)
    return {"errors": errors}


def _run_tp_beside_dp(out: Path, rank: int) -> dict[str, Any]:
    """Issue 30 item 10. Each rank holds a 1-D tensor-parallel mesh of its own (a 1-way TP "group" made
    with ``DeviceMesh.from_group``) beside a data-parallel group made by hand over both ranks: which ranks
    are replicas cannot be told from the weights, so the statistics cannot be summed. The tracker
    (``strict=False``) must refuse at setup, that is when the first measured step's capture begins,
    before any forward pass; a weights-only tracker needs no sum and measures. The same TP slice taken
    from a 2-D ``("dp", "tp")`` mesh (``mesh["tp"]``, the replicas on ``mesh["dp"]``) is measured and
    summed over "dp"."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from hdi_monitor import HDITracker

    dp_group = dist.new_group(list(range(WORLD_SIZE)))  # the user's own data-parallel group
    tp_groups = [dist.new_group([r]) for r in range(WORLD_SIZE)]  # every rank creates every group
    mesh = DeviceMesh.from_group(tp_groups[rank], "cpu", mesh_dim_names=("tp",))
    model = build_plain()
    apply_plain_tp(model, mesh)
    forwards: list[int] = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker = HDITracker(model, every_n_steps=1, projections=PROJECTIONS, log_images_every_n_steps=0, strict=False)
    tokens = global_batches()[0][rank::WORLD_SIZE]
    reached, error = "capture", ""
    try:
        with tracker.capture(tokens):
            reached = "forward"
            logits = model(tokens)
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        for p in model.parameters():  # the hand-made data parallelism: gradients averaged over dp_group
            grad = p.grad.to_local() if is_dtensor_grad(p.grad) else p.grad
            dist.all_reduce(grad, group=dp_group)
            grad /= WORLD_SIZE
        reached = "step"
        tracker.step()
        optimizer.step()
        reached = "trained"
    except ValueError as err:
        error = str(err)
    weights_only = HDITracker(model, every_n_steps=1, projections=PROJECTIONS, activations=False, strict=True)
    m = weights_only.measure()
    sliced = init_device_mesh("cpu", (WORLD_SIZE, 1), mesh_dim_names=("dp", "tp"))
    replica = build_plain()
    apply_plain_tp(replica, sliced["tp"])
    return {
        "hand_made": {"error": error, "reached": reached, "forwards": len(forwards)},
        "weights_only": {r.name: dict(r.hdi) for r in m.report.layers} if m is not None else None,
        "sliced": track(replica, sliced.get_coordinate()[0], WORLD_SIZE),
    }


def is_dtensor_grad(t: Any) -> bool:
    return callable(getattr(t, "to_local", None))


ENGINES = {
    "tp_beside_dp": _run_tp_beside_dp,
    "plain_tp": _run_plain_tp,
    "hf_tp": _run_hf_tp,
    "zero3": _run_zero3,
    "plain_tp_track": _run_plain_tp_track,
    "fsdp_tp_track": _run_fsdp_tp_track,
    "plain_tp_subsample": _run_plain_tp_subsample,
    "zero3_track": _run_zero3_track,
    "stage_mismatch": _run_stage_mismatch,
    "tp_time": _run_tp_time,
    "zero3_time": _run_zero3_time,
}
#: Processes per engine (2 unless a 2 x 2 mesh needs 4).
WORLD = {"fsdp_tp_track": 4}


def scenario(engine: str, out: str | Path) -> None:
    """Run ``engine`` on this rank of the initialised default process group; write ``OUT/rank{R}.json``.

    The tests call this on the ranks of a persistent gloo group (``tests/helpers/pool.py``); the script's
    own ranks call it from `_worker`."""
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD.get(engine, WORLD_SIZE), (engine, dist.get_world_size())
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if engine.startswith("zero3"):
        deepspeed_without_op_builds().init_distributed(dist_backend="gloo")  # joins the existing group
    result = ENGINES[engine](Path(out), rank)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result, indent=1))


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    from gloo_exit import exit_after_barrier  # this script's folder is sys.path[0], also in spawned workers

    world = WORLD.get(args.engine, WORLD_SIZE)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    try:
        scenario(args.engine, args.out)
        dist.barrier()  # no rank tears gloo down while another is still finishing a collective
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_after_barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--engine", choices=sorted(ENGINES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.engine.startswith("zero3"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    mp.spawn(_worker, args=(args, _free_port()), nprocs=WORLD.get(args.engine, WORLD_SIZE), join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
