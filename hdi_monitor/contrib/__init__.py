"""Add-ons beside the monitor: the allocation advisor, the ensemble decomposition, the demo model.

* `allocation`: the head/width allocation law at fixed ``D = H * d_k``, its fit to measured runs
  and the advisor behind ``hdi-monitor allocate`` (the ``advisor`` extra: scipy).
* `ensemble`: `bias_variance_covariance`, the exact error split of an averaging ensemble (for
  controlled experiments with a known target; the monitor never calls it).
* `demo`: `CharLM` and `CharDataModule`, the small character-level model of ``hdi-monitor demo``
  and the examples (its text is the Python standard library's source: no download).

The monitor never imports this package (`demo.run_demo` imports the monitor, inside the function);
each module here may be used from outside.
"""
