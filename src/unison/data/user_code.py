"""One line for an exception raised in the user's own code (a dataset item, a transform, a backbone's forward).

Example::

    try:
        item = dataset[5]
    except Exception as e:
        raise user_raised("your dataset Photos raised at item 5", e) from None
"""

from __future__ import annotations

import os
import sys
import traceback

from unison.errors import DataError

__all__ = ["user_raised"]


def user_raised(what: str, error: BaseException) -> DataError:
    """One line for an exception raised in the user's code: `what` unison was doing ("your dataset X raised at item
    5"), the exception, and the user's frame that raised it (the innermost outside Python's and unison's files)."""
    frames = traceback.extract_tb(error.__traceback__)
    outside = [f for f in frames if not any(f.filename.startswith(p) for p in _LIBRARY_DIRS)]
    chosen = outside or list(frames)
    where = ""
    if chosen:
        frame = chosen[-1]
        where = f" (at {frame.filename}:{frame.lineno} in {frame.name}" + (f": {frame.line}" if frame.line else "") + ")"
    text = str(error).splitlines()[0] if str(error) else ""
    return DataError(f"{what}: {type(error).__name__}: {text}{where}")


_LIBRARY_DIRS = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(__file__))})
