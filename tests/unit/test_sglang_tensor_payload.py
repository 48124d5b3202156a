"""The /update_weights_from_tensor payload (`rollout/sglang/tensor_payload.py`): tensors in shared
memory, read by another process from the file names the pickle carries. The reader here is a
fresh interpreter (no storage cache shared with the writer); SGLang's own SafeUnpickler reads it
in tests/sglang_real."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from entr_megatron.rollout.sglang.protocol import update_weights_from_tensor_payload
from entr_megatron.rollout.sglang.tensor_payload import (
    deserialize_named_tensors,
    serialize_named_tensors,
    shared_buffer,
)

READER = """
import json, sys
from entr_megatron.rollout.sglang.tensor_payload import deserialize_named_tensors
out = []
for payload in json.loads(sys.stdin.read()):
    out.append([(name, str(t.dtype), list(t.shape), t.double().flatten().tolist())
                for name, t in deserialize_named_tensors(payload)])
print(json.dumps(out))
"""


def test_another_process_reads_the_tensors_from_shared_memory():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, generator=g)
    b = torch.randn(7, generator=g).to(torch.bfloat16)
    i = torch.arange(4, dtype=torch.int64)
    flat = shared_buffer(w.nbytes + i.nbytes + b.nbytes)  # SGLang's flattened layout: larger elements first
    views = [flat[32:92].view(torch.float32).view(3, 5), flat[:32].view(torch.int64), flat[92:].view(torch.bfloat16)]
    for view, src in zip(views, (w, i, b)):
        view.copy_(src)
    named = list(zip(("w", "i", "b"), views))
    # one entry per TP rank, each with its own references (a rank's rebuild uses its entry's up)
    payloads = [serialize_named_tensors(named) for _ in range(2)]
    done = subprocess.run([sys.executable, "-c", READER], input=json.dumps(payloads), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for rank in json.loads(done.stdout):
        assert [(n, d, s) for n, d, s, _ in rank] == [("w", "torch.float32", [3, 5]), ("i", "torch.int64", [4]),
                                                      ("b", "torch.bfloat16", [7])]
        for (_, _, _, values), src in zip(rank, (w, i, b)):
            assert values == src.double().flatten().tolist()  # bit for bit: the same pages
    # the pickle names torch's rebuild functions and nothing of ours (what SGLang's SafeUnpickler admits)
    raw = base64.b64decode(payloads[0])
    assert raw[0] == 0x80 and raw[1] <= pickle.HIGHEST_PROTOCOL
    assert b"entr_megatron" not in raw and b"rebuild_storage_filename" in raw and b"rebuild_storage_fd" not in raw


def test_the_body_of_one_bucket():
    body = update_weights_from_tensor_payload(["AAA", "BBB"], flush_cache=True, weight_version="3",
                                              load_format=None, abort_all_requests=False)
    assert body == {"serialized_named_tensors": ["AAA", "BBB"], "flush_cache": True, "abort_all_requests": False,
                    "weight_version": "3"}
    with pytest.raises(ValueError, match="one non-empty base64 string per TP rank"):
        update_weights_from_tensor_payload([], flush_cache=False, weight_version=None, load_format=None,
                                           abort_all_requests=False)


def test_tensors_outside_shared_memory_and_bad_payloads_are_refused():
    with pytest.raises(ValueError, match="must lie in shared memory"):
        serialize_named_tensors([("w", torch.ones(3))])  # the pickle would copy it, or send a descriptor
    with pytest.raises(ValueError, match="only dense CPU tensors"):
        serialize_named_tensors([("w", torch.ones(3, device="meta"))])
    with pytest.raises(ValueError, match="no tensors"):
        serialize_named_tensors([])
    with pytest.raises(ValueError, match="not a tensor payload"):
        deserialize_named_tensors("not base64!")

    class Evil:  # a callable of the standard library (print itself may be patched: Ray's tqdm_ray replaces it)
        def __reduce__(self):
            return (os.getcwd, ())

    evil = base64.b64encode(pickle.dumps([("w", Evil())])).decode()
    with pytest.raises(ValueError, match=r"\.getcwd is not allowed in a tensor payload"):
        deserialize_named_tensors(evil)
    plain = base64.b64encode(pickle.dumps({"w": 1})).decode()
    with pytest.raises(ValueError, match=r"a list of \(name, tensor\) pairs"):
        deserialize_named_tensors(plain)


WRITER = """
import os
import sys
import torch
from entr_megatron.rollout.sglang.tensor_payload import serialize_named_tensors, shared_buffer
os.set_inheritable(os.dup(2), True)  # a copy of stderr left inheritable, as C++ libraries leave theirs
flat = shared_buffer(16)
flat.copy_(torch.arange(16, dtype=torch.uint8))
print(serialize_named_tensors([("w", flat)]), flush=True)
sys.stdin.readline()  # until the reader has mapped the buffer
print("writer done", file=sys.stderr)
"""

HOLDER = """
import sys
from entr_megatron.rollout.sglang.tensor_payload import deserialize_named_tensors
(name, t), = deserialize_named_tensors(sys.stdin.readline().strip())
print(int(t.sum()), flush=True)
sys.stdin.readline()  # holds the mapping (and torch's manager) until told
"""


def test_a_writer_whose_memory_a_server_still_holds_ends_for_a_caller_reading_its_stderr():
    """torch's torch_shm_manager outlives the writer while a reader holds its memory (the server);
    it must not hold the writer's stdin or stderr, or `subprocess.run(capture_output=True)` on the
    writer waits for the server's end (the train command in tests/sglang_real did, 20 min)."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        holder.stdin.write(writer.stdout.readline())
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == str(sum(range(16)))
        out, err = writer.communicate("go\n", timeout=60)  # returns once the writer has exited
        assert writer.returncode == 0 and "writer done" in err
        assert holder.poll() is None  # the reader still holds the memory
    finally:
        for p in (writer, holder):
            p.kill()
            p.wait()


def test_a_buffer_larger_than_the_free_shared_memory_is_refused_by_name(monkeypatch):
    """A container's /dev/shm of 64 MiB: a larger buffer would map, then SIGBUS on first touch."""
    import entr_megatron.rollout.sglang.tensor_payload as payload

    free = os.statvfs_result((4096, 4096, 16384, 16384, 16384, 0, 0, 0, 0, 255))  # 64 MiB free
    monkeypatch.setattr(payload.os, "statvfs", lambda path: free if path == payload.SHM_DIR else os.statvfs(path))
    with pytest.raises(RuntimeError, match=r"/dev/shm has 64 MiB free; a shared buffer of 65 MiB .* --shm-size"):
        payload.shared_buffer((64 << 20) + (1 << 20))
    assert shared_buffer(1 << 20).is_shared()  # what fits is made
