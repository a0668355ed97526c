"""Tests of `hdi_monitor.report`, one file per module (tests/README.md)."""
