"""The math, as pure functions of tensors: no state, no collectives, no ``nn.Module``, no Lightning.

Modules (none imports another package of ``hdi_monitor`` but `hdi_monitor._validation`):

* `diversity`: principal angles, subspace overlaps, the HDI and its reference levels (chance,
  maximum), batched over layers and heads.
* `covariance`: the head-output covariance from a step's moments (`contribution_moments`,
  `merge_moments`, `covariance_results`) and the effective number of heads.
* `kernel`: per-head attention entropy and maximum logit from a layer's own logits and mask
  (`kernel_sums`, `kernel_results`, `attention_kernel_stats`).
* `bilinear`: weight-only statistics of each head's ``W_Q W_K^T`` (`logit_bound`,
  `qk_norm_logit_bound`) and the spectral entropy of a weight update (`update_entropy`).
* `trend`: the Theil-Sen slope of a short series and the redundant head pairs of an overlap or
  correlation matrix (`theil_sen_slope`, `redundant_pairs`), under the saturation detector.
* `_numerics` (private): the float32/float64 guards (`no_autocast`, `ieee_float32_matmul`).

Everything listed in a module's ``__all__`` may be used from outside (see the API reference); the
accumulators that keep a measured step's state are in `hdi_monitor.measure`.
"""
