"""Helpers shared by the unit and distributed tests of test_curves."""

from unison.equivalence import CURVE_TOLERANCE, CurvesReport


def _report(rel, precision="float32"):
    curves = {1: [1.0] * len(rel), 2: [1.0 + r for r in rel]}
    return CurvesReport("simclr", (1, 2), len(rel), 64, precision, CURVE_TOLERANCE[precision], curves, rel,
                        {1: 0.5, 2: 0.5}, {1: 1.0, 2: 1.0})
