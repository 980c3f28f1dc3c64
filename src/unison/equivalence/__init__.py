"""`unison check`: W workers against one worker on the global batch.

* `steps`: the production training step for a few steps, loss / gradients / state compared;
* `curves`: whole `unison train` runs at 1 and W workers, loss curves compared (``--run``);
* `compare`: the relative-difference measure both use (and the tests).
"""

from .compare import RELATIVE_FLOOR, assert_states_close, max_rel_difference
from .curves import CURVE_TOLERANCE, CurveSpec, CurvesReport, run_curves, run_curves_for_check
from .steps import (
    TOLERANCE,
    CheckReport,
    CheckSpec,
    check_methods,
    compare,
    record_steps,
    run_equivalence,
    run_equivalence_all,
    train_config_for,
)

__all__ = ["CURVE_TOLERANCE", "RELATIVE_FLOOR", "TOLERANCE", "CheckReport", "CheckSpec", "CurveSpec", "CurvesReport",
           "assert_states_close", "check_methods", "compare", "max_rel_difference", "record_steps", "run_curves",
           "run_curves_for_check", "run_equivalence", "run_equivalence_all", "train_config_for"]
