"""`HeadCovarianceAccumulator`: a measured step's head-output covariance, streamed and mergeable.

The math is in `hdi_monitor.functional.covariance` (the moments of a batch, Chan's merge, the
metrics); this module keeps the state of one layer and decides which tokens go in. The state is
float64 ``(n, sum_t c_h(t), M2)``: ``H^2 + H D + 1`` numbers per layer whatever the batch or sequence
length, declared as `hdi_monitor.measure.accumulators.Accumulator` states (``n`` and ``sum`` add,
``M2`` is centred), so `merge`, the state dict and the multi-rank sum
(`hdi_monitor.measure.accumulators.sync_accumulators`) come from the base class.

`compute_results` turns any number of accumulators into results with one device-to-host
transfer per device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from hdi_monitor._validation import check_choice, check_instance, check_int
from hdi_monitor.functional._numerics import ieee_float32_matmul, no_autocast
from hdi_monitor.functional.covariance import (
    HeadCovarianceResult,
    WOutSource,
    as_head_weights,
    budget_mask,
    contribution_moments,
    covariance_from_moments,
    covariance_results,
    merge_moments,
    subsample_mask,
)
from hdi_monitor.measure.accumulators import Accumulator, StateSpec

__all__ = ["HeadCovarianceAccumulator", "MatmulDtype", "compute_results"]

_F64 = torch.float64

MatmulDtype = Literal["auto", "float32", "float64"]


class HeadCovarianceAccumulator(Accumulator):
    """Streaming, exact head-contribution covariance for one layer, in ``O(H^2 + H D)`` memory.

    State (float64, on the device of the first ``o`` or of ``device``): token count ``num_tokens``
    (int64), ``sum`` of the contributions ``c_h(t) = W_O,h o_h(t)`` (``H x D``), and the centred
    cross sums ``m2``, ``M2_ij = sum_t <c_i(t) - mean c_i, c_j(t) - mean c_j>`` (``H x H``):
    `state_nbytes` is ``8 (H^2 + H D + 1)``. See `hdi_monitor.functional.covariance` for the
    algorithm and the precision of each step.

    ``W_O`` is read when head outputs arrive (in `update`), from ``w_out`` given here or to
    ``update``. Read inside the forward pass it is the ``W_O`` that produced the head outputs, so
    `compute` may run at any later time (after the optimizer step too) and needs no weights.

    Args:
        num_heads: ``H``.
        head_dim: ``d``.
        w_out: where to read ``W_O`` (see `WOutSource`): a tensor ``(H, D, d)`` or ``(D, H d)``,
            or a zero-argument callable returning one (called once per `update`; e.g.
            ``functools.partial(layer.head_weights, "output")``). May also be passed to each
            `update` instead.
        model_dim: ``D``, the width of the contributions. Needed only by a multi-rank sync on a rank
            whose accumulator saw no tokens and whose ``w_out`` is a callable (otherwise the
            callable would be called there, which under FSDP2 is a collective on that rank alone).
        max_tokens: if set, each `update` call keeps at most this many of its (unmasked)
            tokens, chosen uniformly at random without replacement (see `subsample_mask`).
        total_tokens: if set, all `update` calls together (until `reset`) keep at most this many
            tokens: a call that could pass the budget keeps a uniform random subsample of its kept
            tokens, as many as the budget has left (see `budget_mask`; no host sync). A module
            called several times per forward pass (ALBERT's shared layer) or several micro-batches
            then cannot let more than this through. Tokens added by `merge` count against it too.
        device: where to keep the state; default: the device of the first ``o``.
        generator: RNG for the subsampling; it may live on another device. None: a private CPU
            generator seeded with 0, owned by the accumulator (the global generators are never
            drawn from).
        chunk_size: tokens per chunk in `update`; default: as many as fit
            `hdi_monitor.functional.covariance.DEFAULT_CHUNK_BYTES`.
        matmul_dtype: dtype of the two chunk products: ``"auto"`` (float64 when the state is on the
            CPU, where it costs about twice float32, or when the head outputs or ``W_O`` are float64;
            else float32, since float64 matmuls run at 1/64 of the float32 rate on many GPUs),
            ``"float32"`` or ``"float64"``. Everything else is float64 whatever this says.

    Distributed use: each rank updates with its own tokens, then **every rank** calls
    `hdi_monitor.measure.accumulators.sync_accumulators` on all its accumulators at once (or
    `sync` on each, in the same order): a collective. After a sync the state is the all-rank
    total; call `reset` before accumulating the next window.
    """

    STATE_NAMES = ("num_tokens", "sum", "m2")

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        w_out: WOutSource | None = None,
        model_dim: int | None = None,
        max_tokens: int | None = None,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
        matmul_dtype: MatmulDtype = "auto",
        total_tokens: int | None = None,
    ) -> None:
        check_int("num_heads", num_heads)
        check_int("head_dim", head_dim)
        for name, value in (
            ("model_dim", model_dim),
            ("max_tokens", max_tokens),
            ("chunk_size", chunk_size),
            ("total_tokens", total_tokens),
        ):
            if value is not None:
                check_int(name, value)
        check_instance("generator", generator, torch.Generator, optional=True)
        check_choice("matmul_dtype", matmul_dtype, MatmulDtype)
        super().__init__(device)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.width = num_heads * head_dim
        if isinstance(w_out, Tensor):
            w_out = as_head_weights(w_out, num_heads, head_dim)
            if model_dim is not None and w_out.shape[1] != model_dim:
                raise ValueError(f"w_out has D={w_out.shape[1]} but model_dim={model_dim}")
            model_dim = w_out.shape[1]
        elif w_out is not None and not callable(w_out):
            raise TypeError(
                f"w_out must be a tensor, a zero-argument callable returning one, or None, got {type(w_out).__name__}"
            )
        self.w_out = w_out
        self.model_dim = model_dim
        self.max_tokens = max_tokens
        self.total_tokens = total_tokens
        self._offered = 0  # host upper bound on the tokens taken since the last reset (no sync)
        self.generator = generator if generator is not None else torch.Generator().manual_seed(0)
        self.chunk_size = chunk_size
        self.matmul_dtype = matmul_dtype
        self._n_host: int | None = None  # host copy of n, valid until the state changes

    # ---------------------------------------------------------------- declared state
    def _specs(self) -> dict[str, StateSpec]:
        h = self.num_heads
        return {
            "num_tokens": StateSpec((), torch.int64, "sum"),
            "sum": StateSpec((h, self._resolve_model_dim()), _F64, "sum"),
            "m2": StateSpec((h, h), _F64, "centred"),
        }

    def _compatible(self) -> tuple[Any, ...]:
        return (self.num_heads, self.head_dim)

    def _compatible_dict(self) -> dict[str, Any]:
        return {"num_heads": self.num_heads, "head_dim": self.head_dim}

    def _describe(self) -> str:
        return f"H={self.num_heads}, d={self.head_dim}"

    def _load_sizes(self, tensors: dict[str, Tensor]) -> None:
        s, m2 = tensors["sum"], tensors["m2"]
        h = self.num_heads
        if s.ndim != 2 or s.shape[0] != h or tuple(m2.shape) != (h, h):
            raise ValueError(
                f"state tensors have shapes sum={tuple(s.shape)}, m2={tuple(m2.shape)}; expected ({h}, D) and "
                f"({h}, {h}) (a state saved by the older (H d)^2 accumulator cannot be converted)"
            )
        if self.model_dim is not None and s.shape[1] != self.model_dim:
            raise ValueError(f"state has D={s.shape[1]}, this accumulator has D={self.model_dim}")
        self.model_dim = int(s.shape[1])
        self._n_host = None
        self._offered = self.total_tokens or 0  # unknown here: later updates check the budget on the device

    def _merge_centred(self, mine: dict[str, Tensor], theirs: dict[str, Tensor]) -> None:
        a = (mine["num_tokens"], mine["sum"], mine["m2"])
        b = (theirs["num_tokens"], theirs["sum"], theirs["m2"])
        mine["m2"].copy_(merge_moments(a, b)[2])
        self._n_host = None

    def _centred_for_sync(self, local: dict[str, Tensor], totals: dict[str, Tensor]) -> dict[str, Tensor]:
        # M2_r + <s_r - n_r mu, s_r - n_r mu> / n_r adds up over the ranks to the global centred M2
        n_local = local["num_tokens"].to(_F64)
        mean = totals["sum"] / totals["num_tokens"].clamp_min(1.0)
        shift = local["sum"] - n_local * mean  # n_r (mean_r - mu)
        return {"m2": local["m2"] + (shift @ shift.transpose(0, 1)) / n_local.clamp_min(1.0)}

    # ---------------------------------------------------------------- state
    @property
    def num_tokens(self) -> int:
        """Tokens accumulated so far (a host sync when the state is on an accelerator, unless
        `compute_results` has just read it)."""
        if self._states is None:
            return 0
        if self._n_host is None:
            self._n_host = int(self._states["num_tokens"])
        return self._n_host

    @staticmethod
    def state_numel(num_heads: int, model_dim: int) -> int:
        """Numbers in the state of one layer: ``H^2 + H D + 1`` (stored as 8-byte numbers)."""
        return num_heads * num_heads + num_heads * model_dim + 1

    @property
    def state_nbytes(self) -> int:
        """Bytes held by the state tensors: ``8 (H^2 + H D + 1)`` once allocated, else 0."""
        return sum(t.numel() * t.element_size() for t in self._states.values()) if self._states else 0

    def reset(self) -> None:
        """Forget every token (the state is freed; the device choice and ``w_out`` are kept)."""
        super().reset()
        self._n_host = None
        self._offered = 0

    def _read_w_out(self, w_out: WOutSource | None) -> Tensor:
        src = self.w_out if w_out is None else w_out
        if src is None:
            raise ValueError(
                "no W_O to form the head contributions: give the accumulator w_out= (a tensor (H, D, d) or "
                "(D, H*d), or a callable returning one) or pass update(o, w_out=...)"
            )
        w = as_head_weights(src if isinstance(src, Tensor) else src(), self.num_heads, self.head_dim)
        if self.model_dim is not None and w.shape[1] != self.model_dim:
            raise ValueError(
                f"w_out has D={w.shape[1]}, but this accumulator's contributions are D={self.model_dim} wide"
            )
        return w

    def _resolve_model_dim(self) -> int:
        if self.model_dim is None:
            self.model_dim = self._read_w_out(None).shape[1]
        return self.model_dim

    # ---------------------------------------------------------------- update
    @torch.no_grad()
    def update(self, o: Tensor, keep_mask: Tensor | None = None, *, w_out: WOutSource | None = None) -> None:
        """Add a batch of head outputs.

        Args:
            o: ``(..., H * d)`` concatenated head outputs, head-major. Any real float dtype; it is
                read ``chunk_size`` tokens at a time, so temporaries stay bounded. ``o`` is read as
                ``o.reshape(-1, H * d)``, a view when ``o`` is contiguous (a non-contiguous ``o`` is
                copied once).
            keep_mask: None, or a bool tensor broadcastable to ``o.shape[:-1]``; True marks real
                tokens, False (padding) tokens are left out (whatever they hold, NaN included).
            w_out: ``W_O`` for this batch (see `WOutSource`); default: the accumulator's ``w_out``.

        With ``max_tokens`` set, at most that many kept tokens of this call are used, chosen
        uniformly at random without replacement (one ``randperm`` over the call's tokens).
        The call does not synchronise with the host.
        """
        if self._synced:
            raise RuntimeError(
                "this accumulator was synced across ranks and now holds the all-rank total; call reset() "
                "before accumulating new tokens"
            )
        if not isinstance(o, Tensor):
            raise TypeError(f"o must be a torch.Tensor, got {type(o).__name__}")
        if not o.is_floating_point():
            raise TypeError(f"o must be a real floating tensor, got {o.dtype}")
        if o.ndim < 1 or o.shape[-1] != self.width:
            raise ValueError(
                f"o must have shape (..., H*d) = (..., {self.width}) for H={self.num_heads}, d={self.head_dim}, "
                f"got {tuple(o.shape)}"
            )
        keep: Tensor | None = None
        if keep_mask is not None:
            if not isinstance(keep_mask, Tensor):
                raise TypeError(f"keep_mask must be a torch.Tensor or None, got {type(keep_mask).__name__}")
            if keep_mask.dtype != torch.bool:
                raise TypeError(
                    f"keep_mask must be a bool tensor (True = real token), got {keep_mask.dtype}; "
                    "convert an attention mask with mask.bool()"
                )
            try:
                keep = torch.broadcast_to(keep_mask, o.shape[:-1]).reshape(-1)
            except RuntimeError as err:
                raise ValueError(
                    f"keep_mask of shape {tuple(keep_mask.shape)} does not broadcast to o.shape[:-1] = "
                    f"{tuple(o.shape[:-1])}"
                ) from err
        w = self._read_w_out(w_out)
        if self.model_dim is None:
            self.model_dim = w.shape[1]
        states = self._allocate(o.device)
        flat = o.detach().reshape(-1, self.width)
        n_tok = flat.shape[0]
        if keep is not None:
            keep = keep.to(flat.device)
        keep = self._choose(keep, n_tok, flat.device)
        self._offered += n_tok
        if n_tok == 0:
            return
        device = states["sum"].device
        wide = o.dtype == _F64 or w.dtype == _F64 or device.type == "cpu"
        dtype = {"auto": _F64 if wide else torch.float32, "float32": torch.float32, "float64": _F64}[self.matmul_dtype]
        with no_autocast(), ieee_float32_matmul():
            batch = contribution_moments(flat, keep, w.to(device=device), dtype=dtype, chunk=self.chunk_size)
        mine = (states["num_tokens"], states["sum"], states["m2"])
        for t, merged in zip(mine, merge_moments(mine, batch), strict=True):
            t.copy_(merged)
        self._n_host = None

    def _choose(self, keep: Tensor | None, n_tok: int, device: torch.device) -> Tensor | None:
        """The tokens of a call of ``n_tok`` tokens that `update` uses: ``keep``, then at most
        ``max_tokens`` of them, then at most what is left of ``total_tokens`` (None: all)."""
        if self.max_tokens is not None and self.max_tokens < n_tok:
            if keep is None:
                keep = torch.ones(n_tok, dtype=torch.bool, device=device)
            keep = subsample_mask(keep, self.max_tokens, self.generator)
        if self.total_tokens is not None and self._offered + n_tok > self.total_tokens:
            # this call may pass the budget: keep at most what is left of it (a device-side count)
            if keep is None:
                keep = torch.ones(n_tok, dtype=torch.bool, device=device)
            left = (
                (self.total_tokens - self.states()["num_tokens"]).clamp_min(0).to(device)
                if self._states is not None
                else self.total_tokens
            )
            keep = budget_mask(keep, left, self.generator)
        return keep

    def select_tokens(self, keep: Tensor | None, n_tok: int) -> tuple[Tensor | None, int]:
        """The tokens the next `update` of ``n_tok`` tokens (keep mask ``keep``, flat ``(n_tok,)``)
        would use, chosen now with the accumulator's generator, and the most that can be chosen.

        For callers that must move the chosen tokens before updating (tensor parallelism gathers
        them over ranks): pass the chosen tokens to `update` afterwards, as at most the returned
        number of rows flagged by the mask. Draws what `update` would draw; no host sync.

        Returns:
            ``(mask, cap)``: the ``(n_tok,)`` bool mask of chosen tokens (None: all ``n_tok``) and
            ``cap = min(n_tok, max_tokens, total_tokens)``.
        """
        caps = [c for c in (self.max_tokens, self.total_tokens) if c is not None]
        cap = min([n_tok, *caps])
        device = keep.device if keep is not None else (self._device or torch.device("cpu"))
        return self._choose(keep, n_tok, device), cap

    @torch.no_grad()
    def merge(self, other: Accumulator) -> None:
        """Add ``other``'s tokens to this accumulator (exact, Chan's formula); ``other`` is unchanged."""
        if not isinstance(other, HeadCovarianceAccumulator):
            raise TypeError(f"other must be a HeadCovarianceAccumulator, got {type(other).__name__}")
        if self.model_dim is None and other.model_dim is not None and other._states is not None:
            self.model_dim = other.model_dim
        super().merge(other)
        if other._states is not None:
            self._offered += other._offered if other._offered else (self.total_tokens or 0)

    # ---------------------------------------------------------------- results
    @torch.no_grad()
    def compute(self, *args: Any) -> HeadCovarianceResult:
        """Head-contribution covariance ``C`` and its metrics over the accumulated tokens.

        Needs no weights: ``W_O`` was read in `update`. One device-to-host transfer; for many
        layers use `compute_results` (one transfer for all).

        Raises:
            ValueError: if no token was accumulated.
        """
        if args:
            raise TypeError(
                "compute() takes no W_O any more: the accumulator reads W_O when head outputs arrive; give "
                "it w_out= at construction (or to update())"
            )
        result = compute_results([self], min_tokens=1)[0]
        if result is None:
            raise ValueError(
                "no tokens accumulated: call update() with at least one kept token before compute() "
                "(check keep_mask, and that the head-output hook fired)"
            )
        return result

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"model_dim={self.model_dim}, max_tokens={self.max_tokens}, device={self.device})"
        )


@torch.no_grad()
def compute_results(
    accumulators: Sequence[HeadCovarianceAccumulator], min_tokens: int = 1
) -> list[HeadCovarianceResult | None]:
    """Results of many accumulators (e.g. every layer of a model) with one host transfer per device.

    Args:
        accumulators: the accumulators (any mix of shapes).
        min_tokens: an accumulator with fewer tokens gets None instead of a result.

    Returns:
        One `HeadCovarianceResult` (CPU tensors) or None per accumulator, in order. Each
        accumulator's token count is cached on the host as well, so ``acc.num_tokens`` costs no
        further sync until its state changes.
    """
    check_int("min_tokens", min_tokens)
    covs, counts, live = [], [], []
    for i, acc in enumerate(accumulators):
        if not isinstance(acc, HeadCovarianceAccumulator):
            raise TypeError(f"accumulators[{i}] is a {type(acc).__name__}, not a HeadCovarianceAccumulator")
        if acc._states is None or acc._n_host == 0:
            acc._n_host = 0 if acc._states is None else acc._n_host
            continue
        states = acc.states()
        covs.append(covariance_from_moments(states["num_tokens"], states["m2"]))
        counts.append(states["num_tokens"])
        live.append(i)
    results: list[HeadCovarianceResult | None] = [None] * len(accumulators)
    for i, res in zip(live, covariance_results(covs, counts), strict=True):
        accumulators[i]._n_host = res.num_tokens
        if res.num_tokens >= min_tokens:
            results[i] = res
    return results
