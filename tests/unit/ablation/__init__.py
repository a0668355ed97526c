"""Tests of `hdi_monitor.ablation`, one file per module (tests/README.md)."""
