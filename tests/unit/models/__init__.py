"""Tests of `hdi_monitor.models`, one file per module (tests/README.md)."""
