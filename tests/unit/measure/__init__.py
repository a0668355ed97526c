"""Tests of `hdi_monitor.measure`, one file per module (tests/README.md)."""
