"""Tests of `hdi_monitor.cli`, one file per module (tests/README.md)."""
