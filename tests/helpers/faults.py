"""Helpers of the fault tests: tests/training/test_faults.py and the cluster tests (tests/cluster/)."""

from __future__ import annotations

FAULT = "UNISON_FAULT_INJECT"
