"""Tests of `hdi_monitor.contrib`, one file per module (tests/README.md)."""
