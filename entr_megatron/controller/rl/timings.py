"""Where the controller's time went within a step (the `timing/*` metrics it adds itself)."""

from __future__ import annotations

import contextlib
import time


class StepTimings:
    """Seconds spent in named parts of the controller's work since the last step's record:
    `time(name)` around the work, `take()` returns them as ``timing/<name>`` and starts again."""

    NAMES = ("reward_s", "push_s")

    def __init__(self) -> None:
        self._spent = dict.fromkeys(self.NAMES, 0.0)

    @contextlib.contextmanager
    def time(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._spent[name] += time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        out = {f"timing/{name}": spent for name, spent in self._spent.items()}
        self._spent = dict.fromkeys(self.NAMES, 0.0)
        return out
