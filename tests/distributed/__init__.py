"""Slow tier: several processes, as scenarios of `tests/scripts/` on the session's gloo rank pools (`gloo2`, `gloo4`)."""
