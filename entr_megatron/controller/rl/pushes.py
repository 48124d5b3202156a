"""The controller's side of the weight transport: at most one push in flight, and the version the
engines were last sent.

    pushes = PushSlot(pusher)
    pushes.publish(version, wait=False)   # waits for the push before it, then sends `version`
    pushes.settle()                       # the push in flight has arrived (or raised EngineError)
    pending = pushes.take()               # the push in flight, handed to whoever replaces engines
"""

from __future__ import annotations

from entr_megatron.controller.rl.interfaces import PushHandle, WeightPusher


class PushSlot:
    """Holds the push in flight (`handle`) and the version last sent to the engines (`version`)."""

    def __init__(self, pusher: WeightPusher) -> None:
        self.pusher = pusher
        self.handle: PushHandle | None = None
        self.version = 0

    def settle(self) -> None:
        """Waits for the push in flight, if any (its EngineError reaches the caller)."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def publish(self, version: int, wait: bool) -> None:
        """Sends `version` unless it is the one last sent, after the push before it arrived."""
        self.settle()
        if self.version == version:
            return
        self.handle, self.version = self.pusher.push(version), version
        if wait:
            self.settle()

    def take(self) -> PushHandle | None:
        """The push in flight, no longer this slot's (None: nothing in flight)."""
        handle, self.handle = self.handle, None
        return handle
