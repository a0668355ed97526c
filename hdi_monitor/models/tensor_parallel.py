"""Tensor parallelism and DeepSpeed ZeRO-3 as seen from one attention layer.

What a sharded layer's parameters say about its heads, with no model-family knowledge:

* `full_weight`: a parameter detached, gathered whole if it is a DTensor (FSDP2, TP).
* `logical_shape`: a parameter's full shape (a DTensor's ``shape`` is already global; a ZeRO-3
  parameter is ``[0]`` outside the forward pass and keeps its full shape in ``ds_shape``).
* `tensor_parallel_of`: the tensor-parallel (TP) split of a module's DTensor parameters, or None.
  A mesh dimension is tensor-parallel when its name says so (`TP_MESH_NAMES`), or, unnamed or with
  a name that says neither, when a 2-D weight of the module is sharded along its input features
  (``Shard(1)``: a ``RowwiseParallel`` out-projection; FSDP2 only ever shards dim 0). A dimension
  named data-parallel (`DP_MESH_NAMES`) that splits an input dimension, two TP dimensions, or an
  uneven split are refused out loud.
* `tp_head_counts`: the global head count and width of a TP layer from its full weight's rows and
  the head width, and which attribute counts are global and which this rank's.
* `fused_tp_refusal`: why a fused q/k/v projection split over TP cannot be read, if it cannot.
  ``full_tensor()`` rebuilds the global rows in order for ``Shard(0)`` and ``_StridedShard``
  (transformers ``packed_colwise``) placements alike; ``Shard(0)`` on a ``[q | k | v]`` weight
  would give each rank a row block of the concatenation, which no module's forward uses, so it is
  refused; per-head ``(H, 3, d)`` and per-key/value-group ``(H_kv, H/H_kv + 2, d)`` rows (torchtitan's
  per-kv-head ``wqkv``) keep whole heads on each rank and read right when the split is even.
* `is_zero3_param` / `zero3_params`: DeepSpeed ZeRO-3 partitioned parameters (read whole through
  `hdi_monitor.models.sharding.full_weights`).
* Activations: `gather_heads` (each TP rank holds some heads; the cross-head covariance needs all
  of them for the same tokens) and `sync_data_parallel` (token counts and sums summed over the
  data-parallel ranks only, never over TP ranks, which see the same tokens).

Nothing here imports DeepSpeed or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hdi_monitor.exceptions import AdapterMismatch

__all__ = [
    "DP_MESH_NAMES",
    "TP_MESH_NAMES",
    "TensorParallel",
    "check_same_layers",
    "data_parallel_group",
    "full_weight",
    "fused_tp_refusal",
    "gather_heads",
    "local_share",
    "is_dtensor",
    "is_zero3_param",
    "logical_shape",
    "tensor_parallel_of",
    "tp_head_counts",
    "zero3_params",
]

#: Mesh dimension names that mean tensor parallelism (torchtitan ``tp``, Lightning ``tensor_parallel``).
TP_MESH_NAMES = frozenset({"tp", "tensor_parallel", "tensor", "model_parallel", "mp"})
#: Mesh dimension names that mean data parallelism (FSDP2, HSDP, DDP, context parallel, torchtitan's
#: flattened names, Lightning ``data_parallel``).
DP_MESH_NAMES = frozenset(
    {
        "dp",
        "ddp",
        "fsdp",
        "hsdp",
        "data_parallel",
        "dp_shard",
        "dp_replicate",
        "dp_shard_cp",
        "dp_cp",
        "dp_shard_mod_ep",
        "dp_shard_in_ep",
        "cp",
        "context_parallel",
        "replicate",
        "shard",
    }
)


def is_dtensor(t: object) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (duck-typed: placements, a device mesh, ``full_tensor``)."""
    return callable(getattr(t, "full_tensor", None)) and hasattr(t, "placements") and hasattr(t, "device_mesh")


def is_zero3_param(t: object) -> bool:
    """A DeepSpeed ZeRO-3 partitioned parameter (``ds_id`` and ``ds_shape`` set by ``deepspeed.zero.Init``)."""
    return isinstance(t, Tensor) and hasattr(t, "ds_id") and hasattr(t, "ds_shape")


def zero3_params(module: nn.Module) -> list[nn.Parameter]:
    """The ZeRO-3 partitioned parameters of ``module`` and its descendants, in registration order."""
    return [p for p in module.parameters() if is_zero3_param(p)]


def full_weight(t: Tensor) -> Tensor:
    """Detach a parameter and gather it if it is a DTensor (FSDP2): ``.full_tensor()``.

    Gathering is a collective: under FSDP2 every rank must read the same weights.
    """
    t = t.detach()
    gather = getattr(t, "full_tensor", None)
    if callable(gather):
        t = gather()
    return t


def logical_shape(t: Tensor) -> torch.Size:
    """The full shape of a parameter: ``ds_shape`` for a ZeRO-3 parameter, else ``t.shape`` (global
    for a DTensor)."""
    if is_zero3_param(t):
        return torch.Size(t.ds_shape)  # type: ignore[attr-defined]
    return t.shape


@dataclass(frozen=True)
class TensorParallel:
    """How one attention layer is split by tensor parallelism.

    Attributes:
        size: ranks the heads are split over (the TP degree).
        rank: this rank's coordinate on the TP mesh dimension (it holds heads
            ``[rank * H / size, (rank + 1) * H / size)``).
        mesh: the ``DeviceMesh`` of the layer's parameters.
        mesh_dim: index of the TP dimension in ``mesh``.
        dim_name: its name, or None for an unnamed mesh.
        data_parallel_dims: the other mesh dimensions that shard the layer's parameters (FSDP2), by
            name or index.
    """

    size: int
    rank: int
    mesh: Any
    mesh_dim: int
    dim_name: str | None
    data_parallel_dims: tuple[str | int, ...] = ()

    def group(self) -> Any:
        """The process group of the TP dimension (the ranks that hold this layer's other heads)."""
        return self.mesh.get_group(self.mesh_dim)

    def describe(self) -> str:
        """``"tensor parallel over 2 ranks (mesh dim 'tp')"``."""
        where = repr(self.dim_name) if self.dim_name is not None else f"#{self.mesh_dim}"
        return f"tensor parallel over {self.size} ranks (mesh dim {where})"


def _shard_dim(placement: Any, ndim: int) -> int | None:
    """The tensor dimension a placement splits (``Shard`` or ``_StridedShard``), else None."""
    is_shard = getattr(placement, "is_shard", None)
    dim = getattr(placement, "dim", None)
    if not isinstance(dim, int) or not (
        type(placement).__name__ == "_StridedShard" or (callable(is_shard) and is_shard())
    ):
        return None
    return dim % ndim if ndim else dim


def _mesh_names(mesh: Any) -> tuple[str | None, ...]:
    names = getattr(mesh, "mesh_dim_names", None)
    return tuple(names) if names else (None,) * mesh.ndim


def tensor_parallel_of(module: nn.Module, name: str = "") -> TensorParallel | None:
    """The tensor-parallel split of ``module``'s DTensor parameters, or None if there is none.

    Args:
        module: an attention module (all its descendants' parameters are read).
        name: the layer's name, for error messages.

    Raises:
        AdapterMismatch: the parameters contradict their mesh names (a data-parallel dimension
            splitting a weight's input features), sit on more than one mesh or more than one TP
            dimension, or an unnamed dimension splits some weights by rows and none by columns in a
            way that cannot be told from FSDP.
    """
    label = name or type(module).__name__
    mesh: Any = None
    rowwise: set[int] = set()
    sharded: set[int] = set()
    for p in module.parameters():
        if not is_dtensor(p):
            continue
        pm = p.device_mesh  # type: ignore[attr-defined]
        if mesh is None:
            mesh = pm
        elif pm is not mesh and pm != mesh:
            raise AdapterMismatch(f"{label}: its parameters live on different device meshes; not measured")
        for i, placement in enumerate(p.placements):  # type: ignore[attr-defined]
            sd = _shard_dim(placement, p.ndim)
            if sd is None:
                continue
            sharded.add(i)
            if p.ndim == 2 and sd == 1:
                rowwise.add(i)
    if mesh is None:
        return None
    names = _mesh_names(mesh)
    tp_dims: list[int] = []
    dp_dims: list[str | int] = []
    for i in sorted(sharded):
        n = names[i]
        key = n.lower() if isinstance(n, str) else None
        if key in TP_MESH_NAMES:
            tp_dims.append(i)
        elif key in DP_MESH_NAMES:
            if i in rowwise:
                raise AdapterMismatch(
                    f"{label}: mesh dimension {n!r} is named data-parallel but splits a weight along its input "
                    "features (a tensor-parallel RowwiseParallel split); the heads on each rank cannot be told. "
                    "Not measured"
                )
            dp_dims.append(n if n is not None else i)
        elif i in rowwise:
            tp_dims.append(i)
        else:
            dp_dims.append(n if n is not None else i)
    if not tp_dims:
        return None
    if len(tp_dims) > 1:
        raise AdapterMismatch(
            f"{label}: its heads are split over more than one tensor-parallel mesh dimension "
            f"({[names[i] or i for i in tp_dims]}); not measured"
        )
    dim = tp_dims[0]
    size = int(mesh.size(dim))
    coord = mesh.get_coordinate()
    rank = int(coord[dim]) if coord is not None else 0
    return TensorParallel(size, rank, mesh, dim, names[dim], tuple(dp_dims))


def tp_head_counts(
    label: str,
    *,
    inner: int,
    tp: int,
    num_heads: int | None,
    heads_from: str,
    head_dim: int | None,
    dim_from: str,
) -> tuple[int, int, str]:
    """Global ``(H, d)`` of a tensor-parallel layer and a note saying which count was which.

    ``inner`` is the full out-projection's input width ``H * d`` (from the gathered weight's shape,
    never from an attribute). ``H = inner / d`` with ``d`` the head width (the module's or its
    config's ``head_dim``, which sharding leaves alone). A head-count attribute is accepted only where
    it equals the global ``H`` or this rank's ``H / tp``. Without a head width, a count ``n`` is
    taken as this rank's count when ``n`` is not a multiple of ``tp`` (``n * tp`` heads); where both
    readings fit, the layer is refused (give ``head_dim``).

    Raises:
        AdapterMismatch: no count, a count that fits neither reading, ``H % tp != 0``, or an
            undecidable count; the message names the layer.
    """
    where = f"{label}: {tp}-way tensor parallel"
    if head_dim is not None:
        if inner % head_dim:
            raise AdapterMismatch(
                f"{where}: the full out-projection input ({inner}) is not a multiple of head_dim {head_dim} "
                f"({dim_from})"
            )
        heads = inner // head_dim
        if num_heads is None:
            which = f"{heads} heads of width {head_dim} ({dim_from}) from the full weights"
        elif num_heads == heads:
            which = f"{heads} heads from the full weights; {heads_from} = {num_heads} is the global count"
        elif num_heads * tp == heads:
            which = f"{heads} heads from the full weights; {heads_from} = {num_heads} is this rank's count"
        else:
            local = str(heads // tp) if heads % tp == 0 else f"{heads}/{tp}, not whole"
            raise AdapterMismatch(
                f"{where}: {heads_from} = {num_heads} is neither the global head count ({heads} = {inner} full "
                f"head-output features / head_dim {head_dim}) nor this rank's ({local}); not measured"
            )
    elif num_heads is not None:
        as_local = inner % (num_heads * tp) == 0
        as_global = num_heads % tp == 0 and inner % num_heads == 0
        if as_local and as_global:
            raise AdapterMismatch(
                f"{where}: {heads_from} = {num_heads} could count all heads (width {inner // num_heads}) or this "
                f"rank's (then {num_heads * tp} heads of width {inner // (num_heads * tp)}), and no head_dim tells "
                "which; set head_dim on the module or pass AttentionSpec(num_heads=..., head_dim=...)"
            )
        if not (as_local or as_global):
            raise AdapterMismatch(
                f"{where}: {heads_from} = {num_heads} fits neither as the global nor as this rank's head count of "
                f"{inner} full head-output features; not measured"
            )
        heads = num_heads * tp if as_local else num_heads
        head_dim = inner // heads
        kind = "this rank's" if as_local else "the global"
        which = f"{heads} heads of width {head_dim}; {heads_from} = {num_heads} is {kind} count"
    else:
        raise AdapterMismatch(
            f"{where}: no head count or head width on the module or its config; pass AttentionSpec(num_heads=..., "
            "head_dim=...)"
        )
    if heads % tp:
        raise AdapterMismatch(f"{where}: {heads} heads do not split evenly over {tp} ranks; not measured")
    return heads, head_dim, which


def fused_tp_refusal(label: str, weight: Tensor, packing: str | None, heads: int, kv_heads: int, tp: int) -> str | None:
    """Why a fused q/k/v weight split by tensor parallelism cannot be read whole, or None if it can.

    ``full_tensor()`` rebuilds a ``_StridedShard`` weight (transformers ``packed_colwise``) in its
    global row order. A plain ``Shard(0)`` split hands each rank a contiguous row block: right for
    per-head ``"interleaved"`` rows (whole heads per rank when ``H % tp == 0``) and per-group
    ``"grouped"`` rows (whole key/value groups when ``H_kv % tp == 0``), wrong for ``[q | k | v]``.
    """
    if not is_dtensor(weight) or tp <= 1:
        return None
    kinds = {type(pl).__name__ for pl in weight.placements}  # type: ignore[attr-defined]
    if "_StridedShard" in kinds:
        return None
    if packing == "interleaved" and heads % tp == 0:
        return None
    if packing == "grouped" and kv_heads % tp == 0:
        return None
    return (
        f"{label}: its fused q/k/v projection ({packing} rows) is split {tp} ways by tensor parallelism as plain row "
        "blocks (Shard(0)); each rank would hold a block of the concatenated rows, not whole heads, so the rows' "
        "global order is not known. Not measured (shard it with a strided placement, e.g. transformers "
        "'packed_colwise', or per whole head)"
    )


# ------------------------------------------------------------------------------------------ activations


def local_share(o: Tensor, split: TensorParallel, width: int, label: str = "") -> Tensor:
    """This rank's share of the out-projection input as a plain tensor (a DTensor sharded on its
    last dimension gives its local shard; a tensor already ``width`` wide is returned as it is)."""
    if is_dtensor(o):
        local = o.to_local()  # type: ignore[attr-defined]
        if tuple(local.shape[:-1]) == tuple(o.shape[:-1]) and local.shape[-1] * split.size == width:
            return local  # sharded on the head dimension only: this rank's heads, every token
        return o.full_tensor()  # type: ignore[attr-defined]
    return o


def gather_heads(o: Tensor, split: TensorParallel, width: int, label: str = "") -> Tensor:
    """Every head's output from this rank's share: ``(..., width / tp)`` -> ``(..., width)``.

    Under tensor parallelism the input of a ``RowwiseParallel`` out-projection holds this rank's heads
    only (a plain tensor, or a DTensor sharded on its last dimension where the hook runs after
    torch's input hook). The cross-head covariance needs every head of the same tokens, so the shares
    are gathered over the TP group (each rank holds the heads ``[r H / tp, (r + 1) H / tp)``, so the
    concatenation is head-major). A collective over the TP group: every TP rank runs the same forward
    passes, so every rank reaches it in the same order. A tensor that is already ``width`` wide is
    returned as it is.

    Raises:
        ValueError: the last dimension is neither ``width`` nor ``width / tp``.
    """
    import torch.distributed as dist

    if is_dtensor(o):
        o = o.full_tensor()  # type: ignore[attr-defined]
    if o.shape[-1] == width:
        return o
    if o.shape[-1] * split.size != width:
        raise ValueError(
            f"{label}: the out-projection input has {o.shape[-1]} features, neither all heads ({width}) nor "
            f"one {split.size}-way tensor-parallel share ({width // split.size})"
        )
    group = split.group()
    parts = [torch.empty_like(o) for _ in range(split.size)]
    dist.all_gather(parts, o.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def data_parallel_group(layers: Any) -> tuple[bool, Any]:
    """``(reduce, group)``: over which ranks the head-output statistics of ``layers`` are summed.

    Data-parallel ranks see different tokens and the same heads, so token counts and sums add up
    over them; tensor-parallel ranks see the same tokens (after `gather_heads`, every head), so
    summing over them would count each token ``tp`` times. Without tensor parallelism this is
    ``(True, None)`` (the default group, as before). With it, the group of the mesh's other
    dimension (``(True, group)``), or ``(False, None)`` where the mesh is the TP dimension alone
    and covers every rank (nothing to sum). A 1-D TP mesh sliced from a 2-D (data, tensor) mesh
    (``mesh["tp"]``, with DDP or a plain replica over ``mesh["dp"]``) sums over the root mesh's
    other dimension.

    Raises:
        ValueError: the TP layers sit on different meshes, the mesh has more than one data-parallel
            dimension, or a 1-D TP mesh does not cover every rank and is no slice of a mesh that
            does (a data-parallel group made beside the mesh by hand cannot be known). Found at
            setup (`hdi_monitor.measure.watch.ModelWatch.setup`), before the first step.
    """
    import torch.distributed as dist

    splits = [lay.tensor_parallel for lay in layers if getattr(lay, "tensor_parallel", None) is not None]
    if not splits:
        return True, None
    first = splits[0]
    if any(s.mesh != first.mesh or s.mesh_dim != first.mesh_dim for s in splits[1:]):
        raise ValueError("tensor-parallel layers on different device meshes: their data-parallel ranks are not known")
    others = [i for i in range(first.mesh.ndim) if i != first.mesh_dim]
    if not others:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if first.mesh.size() == world:
            return False, None
        root = _root_mesh(first.mesh)
        names = tuple(getattr(root, "mesh_dim_names", None) or ()) if root is not None else ()
        if root is not None and root.size() == world and first.dim_name in names:
            rest = [i for i in range(root.ndim) if names[i] != first.dim_name]
            if len(rest) == 1:  # mesh["tp"] of a (dp, tp) mesh: the replicas are on the root's other dimension
                return True, root.get_group(rest[0])
            raise ValueError(
                f"the tensor-parallel mesh is a slice of a mesh with {len(rest)} dimensions besides tensor "
                "parallelism; flatten the data-parallel ones"
            )
        raise ValueError(
            f"hdi-monitor: a {first.size}-way tensor-parallel mesh of {first.mesh.size()} rank(s) in a world of "
            f"{world}: the data-parallel replicas are not on the mesh (a data-parallel group made beside it cannot "
            "be known), so the statistics cannot be summed over them. Slice the tensor-parallel mesh from a 2-D "
            '(data, tensor) mesh: init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))["tp"], '
            "or measure weights only (activations=False)"
        )
    if len(others) > 1:
        raise ValueError(
            f"the mesh has {len(others)} dimensions besides tensor parallelism; flatten the data-parallel ones"
        )
    return True, first.mesh.get_group(others[0])


def _root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (``root["tp"]``), or None when it is a root itself or the
    torch version does not say."""
    get = getattr(mesh, "_get_root_mesh", None)  # recent torch
    if not callable(get):
        try:
            from torch.distributed.device_mesh import _mesh_resources  # older torch

            get = getattr(_mesh_resources, "get_root_mesh", None)
            get = (lambda m=mesh, f=get: f(m)) if callable(get) else None
        except ImportError:
            get = None
    if get is None:
        return None
    try:
        root = get()
    except Exception:  # noqa: BLE001 - a private API: without it the slice is not recognised (refused)
        return None
    return None if root is None or root is mesh or root == mesh else root


def check_same_layers(layers: Any, group: Any = None) -> None:
    """Refuse to sum statistics over ranks that watch different layers.

    Pipeline parallelism (each stage holds some layers), or any setup where ranks discovered different
    layers, would otherwise add up unrelated layers whenever their shapes happen to agree. One
    ``all_reduce`` of two integers over ``group``: a checksum of the layers' names and head counts.
    No-op without an initialised process group.

    Raises:
        ValueError: the ranks of ``group`` watch different layers (every rank raises).
    """
    import zlib

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return
    text = ";".join(f"{lay.name}:{lay.num_heads}:{lay.head_dim}:{lay.model_dim}" for lay in layers)
    h = zlib.crc32(text.encode())
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    both = torch.tensor([h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) != h or int(both[1]) != -h:
        raise ValueError(
            "the ranks that sum head-output statistics watch different attention layers (pipeline parallelism, "
            "or a model that differs between ranks); statistics are not summed across them. Under pipeline "
            "parallelism measure weights only (activations=False)"
        )
