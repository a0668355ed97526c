"""Which token mask each watched layer's call is measured with (issue 30, items 3 and 5).

* Encoder-decoder models hand each sub-model its own mask: the decoder layers' kernel statistics
  count the decoder's real queries, the encoder's its own (the first layer's mask key was used for
  every layer: 33 decoder queries for 16 real ones).
* One model called twice in a measured step (a dual encoder: a query batch and a document batch,
  each with its own ``attention_mask``): every call is measured with the mask it received (the
  batch's query mask of the same shape was applied to the documents: 96 tokens for 80 real).
* Where a call's mask cannot be known (no module above the layer takes it as an argument) and the
  model ran more than once, the batch's mask cannot be tied to each call: a warning names the layer.

References: the counted real tokens of each call; the entropies of the model's own attention
probabilities (eager, ``output_attentions=True``) over each call's real queries.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hdi_monitor import HDITracker
from hdi_monitor.exceptions import MonitoringWarning

transformers = pytest.importorskip("transformers")

TOL = 1e-5


def _entropy_sum(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per head, the sum over the kept queries of the entropy of the model's own probabilities."""
    p = probs.double()  # (B, H, T, S)
    ent = -torch.where(p > 0, p * torch.log(p), 0.0).sum(-1)  # (B, H, T)
    return (ent * keep[:, None, :].double()).sum((0, 2))


def _measure(model: nn.Module, batches: list[dict], capture_batch: dict, **settings) -> tuple:
    tracker = HDITracker(model, every_n_steps=1, kernel_stats=True, **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), tracker.capture(capture_batch):
            for batch in batches:
                model(**batch)
        measurement = tracker.step()
    assert measurement is not None
    return tracker, measurement, [w for w in caught if issubclass(w.category, MonitoringWarning)]


# --------------------------------------------------------------------------------------------------
# item 3: each sub-model of an encoder-decoder model with its own mask
# --------------------------------------------------------------------------------------------------


def _seq2seq_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (3, 12), generator=g)
    am = torch.ones(3, 12, dtype=torch.long)
    am[0, 9:] = 0  # 33 real encoder tokens
    dids = torch.randint(3, 60, (3, 12), generator=g)
    dam = torch.zeros(3, 12, dtype=torch.long)
    dam[0, :6] = 1
    dam[1:, :5] = 1  # 16 real decoder tokens: the same (B, T) shape as the encoder's mask
    return {"input_ids": ids, "attention_mask": am, "decoder_input_ids": dids, "decoder_attention_mask": dam}


def _bart(impl: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BartConfig(
        vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        attn_implementation=impl,
    )  # fmt: skip
    return transformers.BartModel(cfg).eval()


def _t5(impl: str) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=60, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        attn_implementation=impl,
    )  # fmt: skip
    return transformers.T5Model(cfg).eval()


def _sub_model_of(name: str) -> str:
    """Which mask (and which of the eager model's attentions) a layer of BART or T5 reads."""
    if name.startswith("encoder."):
        return "encoder"
    return "cross" if ("encoder_attn" in name or "EncDecAttention" in name) else "decoder"


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["bart", "t5"])
def test_encoder_decoder_layers_count_their_own_sub_models_real_queries(family, impl):
    build = {"bart": _bart, "t5": _t5}[family]
    batch = _seq2seq_batch()
    enc_keep, dec_keep = batch["attention_mask"].bool(), batch["decoder_attention_mask"].bool()
    with torch.no_grad():
        out = build("eager")(**batch, output_attentions=True)
    probs = {
        "encoder": list(out.encoder_attentions),
        "decoder": list(out.decoder_attentions),
        "cross": list(out.cross_attentions),
    }
    tracker, m, caught = _measure(build(impl), [batch], batch)
    assert caught == []
    layers = m.report.layers
    assert {_sub_model_of(la.name) for la in layers} == {"encoder", "decoder", "cross"} and len(layers) == 6
    for la, tokens in zip(layers, tracker.last_token_counts, strict=True):
        part = _sub_model_of(la.name)
        keep = enc_keep if part == "encoder" else dec_keep
        real = int(keep.sum())
        assert real == (33 if part == "encoder" else 16)
        assert la.kernel_queries.tolist() == [real] * 4, la.name  # the decoder's were 33: the encoder's mask
        assert tokens == real == la.num_tokens, la.name  # the covariance of the same layer counts the same
        want = _entropy_sum(probs[part].pop(0), keep) / real
        torch.testing.assert_close(la.attention_entropy, want, atol=TOL, rtol=0)


# --------------------------------------------------------------------------------------------------
# item 5: one model, two calls with their own masks
# --------------------------------------------------------------------------------------------------


def _bert(impl: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, attn_implementation=impl,
    )  # fmt: skip
    return transformers.BertModel(cfg).eval()


def _dual_batches():
    g = torch.Generator().manual_seed(0)
    queries = {"input_ids": torch.randint(0, 60, (4, 16), generator=g), "attention_mask": torch.ones(4, 16).long()}
    queries["attention_mask"][:, 12:] = 0  # 48 real query tokens
    docs = {"input_ids": torch.randint(0, 60, (4, 16), generator=g), "attention_mask": torch.ones(4, 16).long()}
    docs["attention_mask"][:, 8:] = 0  # 32 real document tokens: the same shape as the queries' mask
    return queries, docs


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_dual_encoder_measures_each_call_with_its_own_mask(impl):
    queries, docs = _dual_batches()
    eager = _bert("eager")
    with torch.no_grad():
        probs = [eager(**b, output_attentions=True).attentions for b in (queries, docs)]
    tracker, m, caught = _measure(_bert(impl), [queries, docs], queries)
    assert caught == []
    real = int(queries["attention_mask"].sum() + docs["attention_mask"].sum())
    assert real == 80
    assert tracker.last_token_counts == [real, real]  # was 96: the queries' mask applied to the documents
    for i, la in enumerate(m.report.layers):
        assert la.kernel_queries.tolist() == [real] * 4
        calls = zip(probs, (queries, docs), strict=True)
        want = sum(_entropy_sum(p[i], b["attention_mask"].bool()) for p, b in calls) / real
        torch.testing.assert_close(la.attention_entropy, want, atol=TOL, rtol=0)


def test_a_call_without_a_mask_counts_all_its_tokens():
    """A call that passes no mask attends to every token: all of them are real for that call, whatever
    the batch handed to ``capture`` holds."""
    queries, docs = _dual_batches()
    tracker, m, caught = _measure(_bert(), [queries, {"input_ids": docs["input_ids"]}], queries)
    assert caught == []
    assert tracker.last_token_counts == [48 + 64] * 2
    assert all(la.kernel_queries.tolist() == [48 + 64] * 4 for la in m.report.layers)


class _Attention(nn.Module):
    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=pad[:, None, None, :].bool())
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class _Encoder(nn.Module):
    """Its forward takes the mask under another name than the batch key: the call's mask is unknown."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(60, 16)
        self.attn = _Attention()

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.attn(self.emb(ids), pad)


def test_a_batch_mask_that_cannot_be_tied_to_each_call_is_named():
    queries, docs = _dual_batches()
    model = _Encoder().eval()
    tracker = HDITracker(model, every_n_steps=1, kernel_stats=True)
    for calls, expect_warning in ((1, False), (2, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad(), tracker.capture(queries):
                for batch in (queries, docs)[:calls]:
                    model(batch["input_ids"], batch["attention_mask"])
            tracker.step()
        said = [str(w.message) for w in caught if issubclass(w.category, MonitoringWarning)]
        if not expect_warning:
            assert said == [] and tracker.last_token_counts == [48]  # one call: the batch's mask is its mask
        else:
            assert len(said) == 1 and "attn" in said[0] and "2 calls" in said[0] and "mask_key" in said[0], said
