"""Slow tier: end-to-end runs (real Trainers compared bit for bit, resume), the command line and example scripts in a subprocess, logging backends, the documentation pages."""
