"""What the job tells the user on stderr, and how Ctrl-C stops it.

    say("SFT done: runs/demo/sft/model")          # [entr-megatron] SFT done: ...
    with StopFlag() as stop:                       # first Ctrl-C: stop() is True; second: KeyboardInterrupt
        ...
"""

from __future__ import annotations

import signal
import sys

__all__ = ["StopFlag", "say"]


def say(msg: str) -> None:
    """One progress line on stderr (stdout carries the command's JSON result)."""
    print(f"[entr-megatron] {msg}", file=sys.stderr, flush=True)


class StopFlag:
    """SIGINT sets the flag (the loop saves and exits after the step); a second SIGINT raises."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        say("Ctrl-C: finishing this step, saving a checkpoint, then exiting (Ctrl-C again to stop now)")

    def __call__(self) -> bool:
        return self.requested

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)
