"""Where an attention module keeps its head counts: the module itself, the child a layout names,
its own config, or the model's config (`resolve_heads`), each count checked against the weights'
shapes by `hdi_monitor.models.layout.build_layer`."""

from __future__ import annotations

from typing import Any

from torch import nn

from hdi_monitor.models.base import AdapterMismatch
from hdi_monitor.models.tensor_parallel import fused_tp_refusal, is_dtensor, tensor_parallel_of, tp_head_counts

__all__ = [
    "DIM_ATTRS",
    "HEADS_ATTRS",
    "KV_ATTRS",
    "from_config",
    "get_path",
    "holders",
    "lookup",
    "positive_int",
    "resolve_heads",
]

#: Attribute names that hold head counts and widths, tried in order (module, then its config).
HEADS_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "heads")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "n_query_groups")
DIM_ATTRS = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim", "dim_head", "d_kv")


def get_path(module: nn.Module, path: str | None) -> Any:
    obj: Any = module
    for part in path.split(".") if path else ():
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def positive_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def lookup(holders: list[Any], names: tuple[str, ...]) -> tuple[int | None, str]:
    for holder, where in holders:
        if holder is None:
            continue
        for n in names:
            v = positive_int(getattr(holder, n, None))
            if v is not None:
                return v, f"{where}.{n}"
    return None, ""


def from_config(where: str | None) -> bool:
    """Whether a `lookup` location is a config (the module's own or the model's), not the module."""
    return where is not None and where.startswith(("config.", "model.config."))


def holders(module: nn.Module, heads_at: str, root_config: Any) -> list[tuple[Any, str]]:
    holder = get_path(module, heads_at) if heads_at else module
    out: list[tuple[Any, str]] = [(holder, type(holder).__name__)]
    if holder is not module:
        out.append((module, type(module).__name__))
    own = getattr(holder, "config", None) or getattr(module, "config", None)
    if own is not None and not isinstance(own, nn.Module):
        out.append((own, "config"))
    elif root_config is not None:
        out.append((root_config, "model.config"))
    return out


def resolve_heads(
    name: str,
    module: nn.Module,
    *,
    inner: int,
    kv_rows: int | None = None,
    fused_rows: int | None = None,
    packing: str | None = None,
    heads_at: str = "",
    root_config: Any = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    tp: int | None = None,
    notes: list[str] | None = None,
) -> tuple[int, int, int]:
    """``(H, H_kv, d)`` of one attention module, from the given values, the module, or ``config``.

    ``inner`` is ``H * d`` (the out-projection's input width); ``kv_rows`` is ``H_kv * d`` for
    separate key/value projections, ``fused_rows`` the fused projection's row count with its
    ``packing``. Every count found is checked against these widths. All widths are the full
    weights' (a DTensor's global shape, a ZeRO-3 parameter's ``ds_shape``).

    Under tensor parallelism (``tp`` ranks; read from the module's DTensor parameters when None, see
    `hdi_monitor.models.tensor_parallel.tensor_parallel_of`) a count attribute may have been
    rewritten to this rank's share (``num_heads //= tp``): the global counts come from the full
    widths and the head width, an attribute is accepted only where it equals the global or the local
    count (`hdi_monitor.models.tensor_parallel.tp_head_counts`), and ``notes`` (if given) receives
    which it was.

    Raises:
        AdapterMismatch: no head count is known, or the counts do not fit the weights.
    """
    found_in = holders(module, heads_at, root_config)
    where = {}
    if head_dim is None:
        head_dim, where["head_dim"] = lookup(found_in, DIM_ATTRS)
    if num_heads is None:
        num_heads, where["num_heads"] = lookup(found_in, HEADS_ATTRS)
    if num_kv_heads is None:
        num_kv_heads, where["num_kv_heads"] = lookup(found_in, KV_ATTRS)
    cls = type(module).__name__
    if tp is None:
        split = tensor_parallel_of(module, name)
        tp = split.size if split is not None else 1
    tp_note = ""
    if tp > 1:
        heads, head_dim, tp_note = tp_head_counts(
            f"{name} ({cls})",
            inner=inner,
            tp=tp,
            num_heads=num_heads,
            heads_from=where.get("num_heads") or "the given num_heads",
            head_dim=head_dim,
            dim_from=where.get("head_dim") or "given",
        )
    elif head_dim is not None and inner % head_dim == 0:
        heads = inner // head_dim
        if (
            num_heads is not None
            and num_heads != heads
            and from_config(where.get("num_heads"))
            and not from_config(where.get("head_dim"))
        ):
            # the module's own head_dim against a count from the config it shares with its siblings
            # (a pruned Llama layer has fewer heads than config.num_attention_heads): the module wins
            num_heads = heads
        elif num_heads is not None and num_heads != heads and where.get("head_dim"):
            # a head_dim read from config may describe another width (e.g. a partial rotary dim)
            if inner % num_heads:
                raise AdapterMismatch(
                    f"{name}: {cls} has {inner} head-output features, which fit neither "
                    f"{num_heads} heads ({where.get('num_heads') or 'given'}) nor head_dim {head_dim}"
                )
            heads, head_dim = num_heads, inner // num_heads
        elif num_heads is not None and num_heads != heads:
            raise AdapterMismatch(
                f"{name}: {cls}: {num_heads} heads x head_dim {head_dim} != {inner} head-output features"
            )
    elif num_heads is None and head_dim is not None:
        raise AdapterMismatch(f"{name}: {cls}: {inner} head-output features are not a multiple of head_dim {head_dim}")
    elif num_heads is not None:
        if inner % num_heads:
            raise AdapterMismatch(f"{name}: {cls}: {inner} head-output features do not split into {num_heads} heads")
        heads, head_dim = num_heads, inner // num_heads
    else:
        raise AdapterMismatch(
            f"{name}: {cls} has no head count: none of the attributes {HEADS_ATTRS + DIM_ATTRS} on the module or "
            "its config; pass AttentionSpec(num_heads=...)"
        )
    if fused_rows is not None:
        if packing == "interleaved":
            kv = heads
        elif packing == "multi_query":
            kv = 1
        else:
            rest = fused_rows - heads * head_dim
            kv = rest // (2 * head_dim) if rest > 0 and rest % (2 * head_dim) == 0 else 0
        if kv < 1 or fused_rows != (heads + 2 * kv) * head_dim:
            raise AdapterMismatch(
                f"{name}: {cls}: fused projection has {fused_rows} rows, which is not the {packing} packing of "
                f"{heads} query heads of width {head_dim}"
            )
    elif kv_rows is not None:
        if kv_rows % head_dim:
            raise AdapterMismatch(f"{name}: {cls}: key/value width {kv_rows} is not a multiple of head_dim {head_dim}")
        kv = kv_rows // head_dim
    else:
        kv = num_kv_heads or heads
    if tp > 1 and fused_rows is not None:
        # the fused weight (any caller, AttentionSpec included): its rows' global order must be known
        for w in module.parameters():
            if is_dtensor(w) and w.ndim == 2 and fused_rows in (w.shape[0], w.shape[1]):
                refusal = fused_tp_refusal(f"{name} ({cls})", w, packing, heads, kv, tp)
                if refusal is not None:
                    raise AdapterMismatch(refusal)
    if tp > 1:
        if kv % tp:
            raise AdapterMismatch(
                f"{name}: {cls}: {kv} key/value heads do not split evenly over {tp} tensor-parallel ranks; not measured"
            )
        if num_kv_heads is not None and num_kv_heads not in (kv, kv // tp):
            raise AdapterMismatch(
                f"{name}: {cls}: {where.get('num_kv_heads') or 'the given num_kv_heads'} = {num_kv_heads} is neither "
                f"the global key/value head count ({kv}, from the full weights) nor this rank's ({kv // tp})"
            )
        if notes is not None:
            notes.append(f"{tp}-way tensor parallel: {tp_note}")
    elif (
        num_kv_heads is not None
        and num_kv_heads != kv
        and not where.get("num_kv_heads", "").startswith(("config.", "model.config."))
    ):
        # given, or an attribute of the module itself: a contradiction. (A config attribute that the
        # module does not use, e.g. num_key_value_heads of an encoder-decoder, yields to the weights.)
        raise AdapterMismatch(f"{name}: {cls}: {num_kv_heads} key/value heads given, the weights have {kv}")
    if heads % kv:
        raise AdapterMismatch(f"{name}: {cls}: {heads} query heads are not a multiple of {kv} key/value heads")
    return heads, kv, head_dim
