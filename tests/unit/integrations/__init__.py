"""Tests of `hdi_monitor.integrations`, one file per module (tests/README.md)."""
