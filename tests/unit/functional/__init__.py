"""Tests of `hdi_monitor.functional`, one file per module (tests/README.md)."""
