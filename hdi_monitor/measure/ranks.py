"""Do all ranks watch the same thing? One check at setup, before any other collective.

Under ``torch.distributed`` every measured step runs collectives whose number and shapes follow
from the watched layers, the schedule, the projections and the activation settings. Ranks that
disagree on any of these either sum different layers into one value in silence (two layers of the
same shape under different names), wait in a collective the others never reach (a different
``every_n_steps``: until the process group times out) or abort inside the backend (a different
number of layers). `check_ranks_agree` compares a small fingerprint of these settings across
the ranks with one ``all_gather`` of a fixed-size tensor of hashes and raises the same clear error
on every rank, naming the setting that differs and each rank's value.

The pieces are pure functions (`fingerprint`, `digest`, `disagreement`), unit-tested on their
own; the collectives are injectable (``gather`` and ``gather_objects``), so tests need no process
group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from hdi_monitor.models import AttentionLayer

__all__ = ["NO_LAYERS", "SETTINGS", "Agree", "all_agree", "check_ranks_agree", "digest", "disagreement", "fingerprint"]

#: The settings compared across ranks, in this order (the order of the hashes in the collective).
SETTINGS: tuple[str, ...] = (
    "number of layers",
    "layers (names and shapes)",
    "every_n_steps",
    "log_images_every_n_steps",
    "projections",
    "weighting",
    "activations",
    "max_tokens",
    "kernel_stats",
)

Gather = Callable[[Tensor], list[Tensor]]
GatherObjects = Callable[[Any], list[Any]]
Agree = Callable[[bool], bool]
"""``flag -> AND of flag over the ranks``: the collective ``HDITracker.finish`` runs on measured steps
(`all_agree` by default; ``HDITracker.agree`` takes another, e.g. a counting one in tests)."""


#: The "number of layers" of a rank whose discovery failed (it raises its own error, naming why).
NO_LAYERS = "none (this rank found no layer to watch; its own error says why)"


def _layer_text(layer: AttentionLayer) -> str:
    return f"{layer.name} ({layer.num_heads}/{layer.num_kv_heads} heads x {layer.head_dim}, D={layer.model_dim})"


def fingerprint(layers: Sequence[AttentionLayer], config: Any = None, **settings: Any) -> dict[str, str]:
    """The settings every rank must share, as readable text (one entry per name in `SETTINGS`):
    read from ``config`` (a `hdi_monitor.config.MonitorConfig`, its image cadence filled in) or
    given by name in ``settings``.

    Layers are named with their shapes (query heads / key-value heads, head width, model width), in
    the order the collectives visit them.
    """
    if config is not None:
        settings = {name: getattr(config, name) for name in SETTINGS[2:] if name != "log_images_every_n_steps"} | {
            "log_images_every_n_steps": config.image_every_n_steps,
            **settings,
        }
    text = {name: str(settings.get(name)) for name in SETTINGS[2:]}
    text["projections"] = ",".join(settings["projections"])
    for flag in ("activations", "kernel_stats"):
        text[flag] = str(bool(settings.get(flag, False)))
    return {
        "number of layers": str(len(layers)),
        "layers (names and shapes)": "; ".join(_layer_text(la) for la in layers),
        **text,
    }


def digest(fp: dict[str, str]) -> Tensor:
    """One int64 hash per setting of `SETTINGS` (blake2b: the same in every process, unlike ``hash``)."""
    values = []
    for name in SETTINGS:
        raw = hashlib.blake2b(fp[name].encode("utf-8"), digest_size=8).digest()
        values.append(int.from_bytes(raw, "little", signed=True))
    return torch.tensor(values, dtype=torch.int64)


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_difference(a: str, b: str) -> str:
    """For long layer lists: the first entry where two ranks differ."""
    left, right = a.split("; "), b.split("; ")
    for i, (x, y) in enumerate(zip(left, right, strict=False)):
        if x != y:
            return f" (first difference at layer {i}: {x!r} vs {y!r})"
    return ""


def disagreement(fingerprints: Sequence[dict[str, str]]) -> str | None:
    """The error text when the ranks' fingerprints differ (None when they all agree).

    The text names every setting that differs and each rank's value (rank ``r`` is
    ``fingerprints[r]``).
    """
    if not fingerprints:
        return None
    lines = []
    for name in SETTINGS:
        values = [fp.get(name) for fp in fingerprints]
        if len(set(values)) <= 1:
            continue
        per_rank = ", ".join(f"rank {r}: {_shorten(str(v))}" for r, v in enumerate(values))
        extra = ""
        if name == "layers (names and shapes)" and any(len(str(v)) > 300 for v in values):
            ref = str(values[0])
            other = next(str(v) for v in values if v != ref)
            extra = _first_difference(ref, other)
        lines.append(f"  {name} differs: {per_rank}{extra}")
    if not lines:
        return None
    return (
        "hdi-monitor: the ranks do not watch the same thing, so their measurements cannot be combined "
        "(their collectives would mix different layers, or wait for each other until the process group "
        "times out):\n"
        + "\n".join(lines)
        + "\nGive every rank the same model, layers/spec and monitor settings."
        + (
            " Pipeline parallelism (each stage holding different layers) is not supported: measure the whole "
            "model outside the pipeline (head_diversity on a checkpoint) instead."
            if any(name.startswith(("number of layers", "layers")) for name in _differing(fingerprints))
            else ""
        )
    )


def _differing(fingerprints: Sequence[dict[str, str]]) -> list[str]:
    return [name for name in SETTINGS if len({fp.get(name) for fp in fingerprints}) > 1]


def _dist() -> Any:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _default_gather(t: Tensor) -> list[Tensor]:
    dist = _dist()
    assert dist is not None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    local = t.to(device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [x.cpu() for x in out]


def _default_gather_objects(obj: Any) -> list[Any]:
    dist = _dist()
    assert dist is not None
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def check_ranks_agree(
    fp: dict[str, str],
    *,
    gather: Gather | None = None,
    gather_objects: GatherObjects | None = None,
) -> None:
    """Raise the same ValueError on every rank if the ranks' fingerprints differ.

    One ``all_gather`` of ``len(SETTINGS)`` int64 hashes; only when they differ (every rank sees
    that), a second collective gathers the readable fingerprints for the message. A no-op outside
    ``torch.distributed`` (or with one rank) unless ``gather`` is given.

    Args:
        fp: this rank's `fingerprint`.
        gather: ``tensor -> [tensor of rank 0, rank 1, ...]`` (default: ``all_gather``).
        gather_objects: ``object -> [object of rank 0, ...]`` (default: ``all_gather_object``).

    Raises:
        ValueError: the ranks differ; the message names each setting that differs (see
            `disagreement`).
    """
    if gather is None:
        if _dist() is None:
            return
        gather = _default_gather
    hashes = gather(digest(fp))
    if all(torch.equal(h, hashes[0]) for h in hashes[1:]):
        return
    texts = (gather_objects or _default_gather_objects)(fp)
    message = disagreement(texts)
    if message is None:  # a hash collision is not possible in practice; say what is known
        differing = [name for i, name in enumerate(SETTINGS) if len({int(h[i]) for h in hashes}) > 1]
        message = f"hdi-monitor: the ranks do not watch the same thing: {', '.join(differing)} differ"
    raise ValueError(message)


def all_agree(flag: bool) -> bool:
    """Logical AND of ``flag`` over all ranks: one ``all_reduce`` (MIN) of one int32, a collective
    that every rank must reach; ``flag`` itself (no collective) outside ``torch.distributed`` or with
    one rank. ``HDITracker.finish`` calls it twice per measured step (all ranks hold the measurement;
    all ranks computed it) and never on other steps."""
    dist = _dist()
    if dist is None:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
