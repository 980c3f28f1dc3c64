"""Helpers shared by the unit and distributed tests of test_faults."""

from __future__ import annotations

FAULT = "UNISON_FAULT_INJECT"
