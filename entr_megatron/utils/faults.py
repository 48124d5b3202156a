"""Deterministic fault injection for the fault tests: a process kills or stops ITSELF at a named
point, instead of a test polling for the right moment to kill it (a race a slow machine loses).

    ENTR_MEGATRON_TEST_FAULT="engine@2:generate;rank0@5:train"   what, from which version, where
    ENTR_MEGATRON_TEST_FAULT_DIR=/tmp/run-faults                  one marker per fault: fires once

Each item is `<who>@<version>:<point>[:<action>]`: the process named `who` (`engine` for any
embedded engine, `engine<i>` for engine i only where the point knows its index (`receive`),
`rank<r>` for learner rank r, `driver` for the job's controller)
reaching `point` (`generate`: an engine given requests while holding weights of version >=
`version`; `receive`: an engine about to receive a bucket of weight version >= `version`
(the version begun, not finished); `train`: a rank asked to train version >= `version`; `checkpoint`: the driver having
saved the checkpoint of step >= `version`) sends itself SIGKILL (`action` kill, the default) or
SIGSTOP (`stop`, a hang). A fault fires once per fault directory: the replacement of a killed process finds the
marker and goes on. Nothing happens without the variable: production never sets it.
"""

from __future__ import annotations

import os
import signal

__all__ = ["FAULT_DIR_ENV", "FAULT_ENV", "maybe_fault"]

FAULT_ENV = "ENTR_MEGATRON_TEST_FAULT"
FAULT_DIR_ENV = "ENTR_MEGATRON_TEST_FAULT_DIR"
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def _items(spec: str):
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        who, _, rest = item.partition("@")
        version, _, rest = rest.partition(":")
        point, _, action = rest.partition(":")
        if not (who and version.isdigit() and point and (action or "kill") in ACTIONS):
            raise ValueError(f"{FAULT_ENV}={spec!r}: item {item!r} must be <who>@<version>:<point>[:kill|stop]")
        yield item, who, int(version), point, ACTIONS[action or "kill"]


def _names(target: str, who: str) -> bool:
    """`target` (a fault's) names the process `who`: the same name, or its kind without an index
    (`engine` names `engine1`)."""
    return target == who or (who.startswith(target) and who[len(target):].isdigit())


def maybe_fault(who: str, version: int, point: str) -> None:
    """Fire the first armed fault of `who` at `point` whose version is <= `version` (see the module
    docstring). A no-op unless FAULT_ENV is set."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    directory = os.environ.get(FAULT_DIR_ENV)
    if not directory:
        raise ValueError(f"{FAULT_ENV} is set but {FAULT_DIR_ENV} is not: the faults need a directory for "
                         "their fire-once markers")
    for n, (item, target, at, where, sig) in enumerate(_items(spec)):
        if not _names(target, who) or where != point or version < at:
            continue
        try:  # the marker is created before the signal: a replacement never fires it again
            os.close(os.open(os.path.join(directory, f"fault-{n}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        os.kill(os.getpid(), sig)
        return
