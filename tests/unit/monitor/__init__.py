"""Tests of `hdi_monitor.monitor`, one file per module (tests/README.md)."""
