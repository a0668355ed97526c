"""The logit bounds of `hdi_monitor.report.compute_report` (DESIGN.md rule 9), fed the weight
groups as they are read (private to the report)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hdi_monitor.exceptions import AdapterMismatch
from hdi_monitor.functional.bilinear import gram_factor, logit_bound, qk_norm_logit_bound
from hdi_monitor.models import AttentionLayer

__all__ = ["LogitBounds"]


class LogitBounds:
    """The logit bounds of `compute_report` (DESIGN.md rule 9), fed the weight groups as they are read.

    Each query and key group is reduced at once to ``(L, H, d, d)`` factors with the heads' Gram
    matrices (`gram_factor`): the weights themselves are not held past their group. QK-norm layers
    need no weights: their gains are read with their query group (inside a sharded layer's
    gather). `compute` then groups the layers whose factors (or gains) have one shape, position
    rule, key-head map and device, and runs one batched bound per group.
    """

    def __init__(self, layers: Sequence[AttentionLayer], fields: list[dict[str, Any]]) -> None:
        self.layers = layers
        self.fields = fields
        self.factors: dict[tuple[int, str], Tensor] = {}  # (layer, "query" | "key") -> (H, d, d)
        self.gains: dict[int, tuple[Tensor, Tensor, float, float]] = {}  # QK-norm layers
        self.wanted: set[int] = set()
        for i, (lay, res) in enumerate(zip(layers, fields, strict=True)):
            form = lay.logit_form
            d_q, d_k = lay.projection_dims["query"], lay.projection_dims["key"]
            if form.refusal is not None:
                res["notes"] = (*res["notes"], f"logit bound not computed: {form.refusal}")
            elif d_q != d_k:
                res["notes"] = (
                    *res["notes"],
                    f"logit bound not computed: query heads of width {d_q}, key heads of {d_k}",
                )
            else:
                res["notes"] = (*res["notes"], *form.notes)
                self.wanted.add(i)

    def add(self, projection: str, indices: list[int], stacked: Tensor) -> None:
        """Take what the bounds need from one weight group (``(L, H, D_in, d)`` of the layers
        ``indices``) while it is read."""
        if projection not in ("query", "key"):
            return
        rows = [(j, i) for j, i in enumerate(indices) if i in self.wanted]
        by_weights = [(j, i) for j, i in rows if self.layers[i].logit_form.qk_norm is None]
        if by_weights:
            sel = [j for j, _ in by_weights]
            factor = gram_factor(stacked if len(sel) == len(indices) else stacked[sel])
            for n, (_, i) in enumerate(by_weights):
                self.factors[(i, projection)] = factor[n]
        if projection == "query":
            for _, i in rows:
                if self.layers[i].logit_form.qk_norm is not None:
                    self._read_gains(i, stacked.device)

    def _read_gains(self, i: int, device: torch.device) -> None:
        lay = self.layers[i]
        try:
            gains = lay.qk_norm_gains()
        except AdapterMismatch as exc:  # the full gains do not fit the heads: no bound, said so
            self.wanted.discard(i)
            self.fields[i]["notes"] = (*self.fields[i]["notes"], f"logit bound not computed: {exc}")
            return
        self.gains[i] = (gains.query.to(device), gains.key.to(device), gains.radius_query, gains.radius_key)

    def compute(self) -> list[tuple[list[int], Tensor]]:
        """``(layer indices, (L, H) bounds)`` per group, on the weights' device; sets each
        computed layer's ``logit_bound_rule``."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i in sorted(self.wanted):
            lay, form = self.layers[i], self.layers[i].logit_form
            rotary = form.rotary is not False
            if i in self.gains:
                gq, gk, rq, rk = self.gains[i]
                key: tuple[Any, ...] = ("qk_norm", tuple(gq.shape), tuple(gk.shape), gq.dtype, gk.dtype, gq.device)
                key += (rotary, lay.kv_map, rq, rk)
            elif (i, "query") in self.factors and (i, "key") in self.factors:
                fq, fk = self.factors[(i, "query")], self.factors[(i, "key")]
                key = ("weights", tuple(fq.shape), tuple(fk.shape), fq.dtype, fk.dtype, fq.device, rotary, lay.kv_map)
            else:
                continue
            groups.setdefault(key, []).append(i)
        out = []
        for key, members in groups.items():
            rotary, kv_map = (key[6], key[7])
            if key[0] == "qk_norm":
                gq = torch.stack([self.gains[i][0] for i in members])
                gk = torch.stack([self.gains[i][1] for i in members])
                raw = qk_norm_logit_bound(
                    gq, gk, radius_q=key[8], radius_k=key[9], rotary=rotary, kv_map=kv_map, scale=1.0
                )
            else:
                fq = torch.stack([self.factors[(i, "query")] for i in members])
                fk = torch.stack([self.factors[(i, "key")] for i in members])
                raw = logit_bound(fq, fk, rotary=rotary, kv_map=kv_map, scale=1.0)
            scales = torch.tensor(
                [self.layers[i].logit_form.scale for i in members], dtype=raw.dtype, device=raw.device
            )
            out.append((members, raw * scales[:, None]))
            for i in members:
                self.fields[i]["logit_bound_rule"] = self.layers[i].logit_form.rule
        return out
