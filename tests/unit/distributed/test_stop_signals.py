"""`stop_signals_raise`: a stop signal ends the block with the caller's error, wherever it lands."""

from __future__ import annotations

import os
import signal
import time

import pytest

from unison.distributed.signals import stop_requests, stop_signals_raise


class Stopped(Exception):
    pass


def _wait_for_the_signal() -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:   # the handler runs between bytecodes of this loop
        time.sleep(0.01)


def test_a_stop_that_lands_in_an_except_exception_still_ends_the_block():
    """A decode or header probe that catches Exception must not swallow the stop and go on to the end."""
    went_on = False
    with pytest.raises(Stopped, match="SIGTERM"):
        with stop_signals_raise(lambda name: Stopped(name)):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                _wait_for_the_signal()
            except Exception:   # the swallowing site
                pass
            went_on = True
    assert not went_on
    assert not stop_requests().requested   # handled by the block: the record does not outlive it


def test_the_handlers_are_restored_after_the_block():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped):
        with stop_signals_raise(lambda name: Stopped(name)):
            os.kill(os.getpid(), signal.SIGUSR1)
            _wait_for_the_signal()
    assert signal.getsignal(signal.SIGTERM) is before
