"""Test helpers that are not tests: the persistent gloo rank pools (`pool`) and the placement rule check
(`placement`, ``python -m tests.helpers.placement``)."""
