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


def test_a_stop_after_the_training_loop_gave_the_signals_back_names_the_last_checkpoint(tmp_path):
    """The loop restores the handler of the block around it when it ends, also while it fails (an elastic agent: a
    collective failed because a peer was killed, and the elastic agent's SIGTERM to the survivors follows at once).
    That stop must not say that training never started, after steps and checkpoints."""
    from unison.cli import _stop_before_training
    from unison.distributed.signals import install_stop_handlers, restore_default_handlers
    from unison.errors import Preempted
    from unison.training.checkpoint import save_checkpoint

    out = tmp_path / "run"
    last = save_checkpoint(out, {"method": "simclr", "config": {}}, step=6)
    with pytest.raises(Preempted) as before:
        with _stop_before_training(str(out)):
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_the_signal()
    assert str(before.value) == "stopped by SIGTERM before training started: nothing to save; run the same command again"
    with pytest.raises(Preempted) as after:
        with _stop_before_training(str(out)):
            install_stop_handlers()   # the training loop takes the signals over ...
            restore_default_handlers()   # ... and gives them back as it ends
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_the_signal()
    assert str(after.value) == (f"stopped by SIGTERM after its training had stopped: the last checkpoint is {last}; "
                                f"continue with --resume auto --out {out}")
