"""What the job tells the user on stderr, and how Ctrl-C and SIGTERM stop it.

    say("SFT done: runs/demo/sft/model")          # [entr-megatron] SFT done: ...
    with StopFlag(grace_s=25) as stop:             # first Ctrl-C or SIGTERM: stop() is True
        ...                                        # second signal, or the grace over: KeyboardInterrupt

A first SIGINT (Ctrl-C) or SIGTERM (SLURM and Kubernetes preempt with it, then SIGKILL after a
grace period) asks the loop to finish its step, save a checkpoint and return: the job exits 0
and resumes from there. A second signal, or after SIGTERM the grace time running out, raises
KeyboardInterrupt in the main thread: the job unwinds at once, stopping its engines and
learner ranks on the way out (no checkpoint).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["StopFlag", "say"]


def say(msg: str) -> None:
    """One progress line on stderr (stdout carries the command's JSON result)."""
    print(f"[entr-megatron] {msg}", file=sys.stderr, flush=True)


class StopFlag:
    """SIGINT or SIGTERM sets the flag (the loop saves and exits after the step); a second signal,
    or `grace_s` after a SIGTERM, raises KeyboardInterrupt (module docstring)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, grace_s: float | None = None):
        self.requested = False
        self.grace_s = grace_s
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._expired = False

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            if self._expired:
                say(f"the {self.grace_s:g} s grace period is over: stopping now, without a checkpoint")
            raise KeyboardInterrupt
        self.requested = True
        if signum == signal.SIGTERM:
            within = f" within {self.grace_s:g} s" if self.grace_s else ""
            say(f"SIGTERM: finishing this step and saving a checkpoint{within}, then exiting (a second signal "
                "stops at once)")
            if self.grace_s:
                self._timer = threading.Timer(self.grace_s, self._expire)
                self._timer.daemon = True
                self._timer.start()
        else:
            say("Ctrl-C: finishing this step, saving a checkpoint, then exiting (Ctrl-C again to stop now)")

    def _expire(self) -> None:
        self._expired = True
        os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread: the second signal

    def __call__(self) -> bool:
        return self.requested

    def __exit__(self, *exc):
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
