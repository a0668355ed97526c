"""``ablate_heads``: remove heads' contributions while a ``with`` block runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Literal

from torch import Tensor, nn

from hdi_monitor.ablation._hooks import (
    check_heads,
    edit_head_outputs,
    mean_edit,
    resolve_layers,
    zero_edit,
)
from hdi_monitor.models import AttentionLayer

__all__ = ["AblationMode", "ablate_heads"]

AblationMode = Literal["zero", "mean"]


@contextlib.contextmanager
def ablate_heads(
    model: nn.Module,
    heads: Mapping[str, Iterable[int]],
    mode: AblationMode = "zero",
    *,
    means: Mapping[str, Tensor] | None = None,
    layers: Sequence[AttentionLayer] | None = None,
) -> Iterator[nn.Module]:
    """Remove the contributions of some heads while the ``with`` block runs.

    The heads' slices of the concatenated head output ``o`` (the input of the output projection,
    where discovery hooks) are replaced before the output projection: by zero (``mode="zero"``:
    the layer output becomes ``W_O o' + b`` with ``o'_h = 0`` for the ablated heads) or by the
    head's mean output over reference data (``mode="mean"``: ``o'_h = E[o_h]``, from
    `head_output_means`; the layer output then keeps the heads' average contribution, which
    keeps the residual stream's offset). Works for every family discovery knows, grouped-query
    attention included (a query head is ablated; its key/value head still serves the others).

    On exit, also on an exception, every hook is removed and the model is as it was: no parameter,
    buffer or flag is changed. Gradients flow through the edited outputs; for
    ``nn.MultiheadAttention`` the correction term is computed from detached weights (ablation there
    is for evaluation, not training), and the attention weights the module returns with
    ``need_weights=True`` are its own (ablation edits head outputs, not attention patterns).

    Args:
        model: the model.
        heads: ``{layer name: [head indices]}``, names as in ``model.named_modules()`` (and
            ``AttentionLayer.name``); indices are query heads ``0..num_heads - 1``.
        mode: ``"zero"`` or ``"mean"``.
        means: ``{layer name: (H * d,) mean head output}``, required for ``mode="mean"``.
        layers: attention layers from `hdi_monitor.models.find_attention_layers` (default:
            discovered here).

    Yields:
        ``model`` itself.

    Raises:
        ValueError: an unknown layer name, an out-of-range head, an unknown mode, or
            ``mode="mean"`` without a mean for an ablated layer.

    Example:

    ```python
    with ablate_heads(model, {"encoder.layer.0.attention": [3, 7]}):
        out = model(**batch)
    ```
    """
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean', got {mode!r}")
    by_name = resolve_layers(model, layers)
    chosen = {name: idx for name, idx in check_heads(heads, by_name).items() if idx}
    edits = {}
    for name, idx in chosen.items():
        layer = by_name[name]
        if mode == "zero":
            edits[name] = zero_edit(idx, layer.num_heads)
            continue
        if means is None or name not in means:
            raise ValueError(
                f"mode='mean' needs means[{name!r}]: compute them with head_output_means(model, reference_batches)"
            )
        mean = means[name]
        width = layer.num_heads * layer.head_dim
        if not isinstance(mean, Tensor) or tuple(mean.shape) != (width,):
            raise ValueError(
                f"means[{name!r}] must be a tensor of shape ({width},), got {getattr(mean, 'shape', mean)!r}"
            )
        edits[name] = mean_edit(idx, layer.num_heads, mean)
    with edit_head_outputs(by_name, edits):
        yield model
