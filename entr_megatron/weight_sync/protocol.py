"""The versioned bucket protocol between a learner stage (rank 0) and the engines of its group.

One version on one group, every message a broadcast from rank 0:

    per bucket:  control int64[5] = (BUCKET, version, header bytes, data bytes, chunk bytes)
                 header  uint8[header bytes]  = BucketLayout JSON (names, dtypes, shapes, alone)
                 data    uint8[data bytes]    = the flat bucket (SGLang's flattened layout), as
                         consecutive broadcasts `BucketLayout.ranges(chunk bytes)`: each
                         segment (an `alone` tensor, or a run of the others) in pieces of
                         at most `chunk bytes`
    at the end:  control (END, version, 0, number of buckets, 0), then an all-reduce of one
                 int64: each engine rank adds 1 if it could not take the version
    on failure:  control (ABORT, version, header bytes, 0, 0) + header = the learner's error (UTF-8)

Metadata goes first so that receivers allocate (or reuse) a buffer of the right size
before the bytes come; a bucket's bytes travel in a few large chunks whatever the
number of tensors in it. Tensors the learner sends straight from its parameters
(`WeightSyncConfig.snapshot="borrow"`) are `alone`: no piece mixes their bytes with
copied ones. Both sides keep several pieces in flight (`BroadcastGroup.broadcast_pieces`):
each receiver has posted the next piece before the current one ends, so the stream does
not stall between pieces, and the sender sends a piece as soon as the learner has copied it. The closing all-reduce tells the learner that every engine holds the complete
version (its transfer time ends there), or that one refused it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from entr_megatron.weight_sync.group import BroadcastGroup

__all__ = ["ABORT", "BUCKET", "END", "KINDS", "Control", "recv_control", "send_control"]

BUCKET, END, ABORT = 1, 2, 3
KINDS = {BUCKET: "bucket", END: "end", ABORT: "abort"}


class Control(NamedTuple):
    """The fixed-size first broadcast of every message."""

    kind: int
    version: int
    header_len: int
    data_len: int
    chunk_len: int
    """Data bytes per broadcast at most (0: each segment in one; `BucketLayout.ranges`)."""


def send_control(group: BroadcastGroup, kind: int, version: int, header: bytes = b"", data_len: int = 0,
                 chunk_len: int = 0) -> None:
    """Rank 0: broadcast a control message and its header (the data, if any, follows separately)."""
    group.broadcast(torch.tensor([kind, version, len(header), data_len, chunk_len], dtype=torch.int64))
    if header:
        group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))


def recv_control(group: BroadcastGroup) -> tuple[Control, bytes]:
    """An engine rank: the next control message and its header."""
    ctrl = torch.empty(len(Control._fields), dtype=torch.int64)
    group.broadcast(ctrl)
    control = Control(*(int(x) for x in ctrl.tolist()))
    if control.kind not in KINDS:
        raise RuntimeError(f"weight group {group.spec.group_name!r}: unknown message kind {control.kind} "
                           "(the learner speaks another protocol version?)")
    header = b""
    if control.header_len:
        buf = torch.empty(control.header_len, dtype=torch.uint8)
        group.broadcast(buf)
        header = buf.numpy().tobytes()
    return control, header
