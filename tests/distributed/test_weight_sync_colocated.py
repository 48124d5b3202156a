"""Colocated weight handoff (weight_sync/colocated.py): the learner copies each bucket into the
engine's shared staging copy; the versions, refusals and aborts of the broadcast path hold.

The protocol tests run sender and receivers as threads of this process (the shared memory is
opened through /proc/<pid>/fd as from another process; refusals and aborts are tested beside the
broadcast's, in test_weight_sync.py); the end-to-end test pushes from two gloo
learner ranks (TP = 2) into an `EmbeddedEngine` process and compares the engine's log-probs with
the learner's, as tests/distributed/test_weight_sync.py does for the broadcast."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_weight_sync import (  # noqa: F401 - model_dir: the module fixture
    ATOL,
    Engines,
    Model,
    assert_holds,
    engine_minus_learner,
    engine_on_rank0,
    model_dir,
    named,
    start_learner,
)

from entr_megatron.utils.spawn import free_port, run_gloo
from entr_megatron.weight_sync import WeightSync, WeightSyncConfig, receiver_for, stage_groups
from entr_megatron.weight_sync.colocated import (
    ColocatedReceiver,
    ColocatedTransport,
    open_handle,
    share_handle,
    shared_bytes,
)


def test_a_handle_opens_the_same_bytes_in_another_process():
    flat = shared_bytes(4096)
    flat.zero_()
    handle = share_handle(flat[1024:2048])
    code = ("import json, sys, torch; from entr_megatron.weight_sync.colocated import open_handle; "
            "t = open_handle(json.loads(sys.argv[1])); t.copy_(torch.arange(t.numel()) % 251)")
    subprocess.run([sys.executable, "-c", code, json.dumps(handle)], check=True, timeout=60)
    want = torch.zeros(4096, dtype=torch.uint8)
    want[1024:2048] = torch.arange(1024) % 251
    assert torch.equal(flat, want)
    with pytest.raises(ValueError, match="not in shared memory"):
        share_handle(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="no longer the engine's shared weight buffer"):
        open_handle({**handle, "inode": handle["inode"] + 1})
    with pytest.raises(ValueError, match="cannot open the engine's shared weights"):
        open_handle({**handle, "pid": 2**22 + 17})
    with pytest.raises(ValueError, match="unknown shared-memory handle kind"):
        open_handle({"kind": "cuda_ipc"})
    if not torch.cuda.is_available():  # an engine on a GPU this process cannot see (tests/gpu open one)
        with pytest.raises(ValueError, match="weights are on GPU 0, which this process cannot see"):
            open_handle({"kind": "cuda", "device": 0, "pid": 1})


@pytest.mark.parametrize("bucket_bytes, dtype", [(100, None), (512 << 20, None), (300, "float64")])
def test_versions_land_in_the_engines_stages(bucket_bytes, dtype):
    """Two engines, three versions: each holds exactly what was pushed (tied names kept tied); from
    the second version on the learner writes into the same two shared buffers per bucket and engine
    (the stage's and the model's, swapped each version) and maps nothing new. float64: a cast on receipt, so the
    bytes land in the engines' scratch buffers and are loaded from there."""
    groups = stage_groups("127.0.0.1", free_port(), pp_size=1, engine_ranks=(1, 1), backend="gloo")
    engines = Engines(groups, 2, colocated=True)
    transport = ColocatedTransport(groups[0], timeout_s=30)
    sources = {}
    sync = WeightSync(lambda: named(sources["now"]), transport,
                      WeightSyncConfig(bucket_bytes=bucket_bytes, dtype=dtype, snapshot="borrow", borrow_min_bytes=1))
    mapped = []
    for version in (1, 2, 3, 4):
        source = sources["now"] = Model(seed=version)
        engines.receive(version)
        pushed = Model(seed=version)
        handle = sync.push(version)
        sync.wait_borrowed(timeout=60)
        with torch.no_grad():
            for p in source.parameters():  # the learner moves on once the borrowed tensors are copied
                p.add_(1.0)
        report = handle.wait(timeout=60)
        engines.join()
        assert engines.errors == [None, None]
        for m in engines.models:
            if dtype is None:
                assert_holds(m, pushed)
            else:  # float64 on the wire, the engine's dtypes on receipt
                for name, t in pushed.state_dict().items():
                    torch.testing.assert_close(m.state_dict()[name], t.double().to(t.dtype), atol=0, rtol=0)
            assert m.out.weight is m.emb.weight
        assert transport.copies == 2 * report.num_buckets * version
        mapped.append(len(transport._mapped))
    buckets = report.num_buckets
    if dtype is None:  # per bucket and engine, the stage's buffer and the model's alternate: two, mapped once each
        assert mapped == [2 * buckets] + [4 * buckets] * 3, mapped
    else:  # one scratch buffer per engine, reused
        assert mapped[-1] == 2, mapped
    sync.close()


def test_a_handle_the_learner_cannot_open_aborts_the_version_naming_why(monkeypatch):
    from entr_megatron.weight_sync import colocated

    groups = stage_groups("127.0.0.1", free_port(), pp_size=1, backend="gloo")
    engines = Engines(groups, 1, colocated=True)
    source = Model(seed=1)
    sync = WeightSync(lambda: named(source), ColocatedTransport(groups[0], timeout_s=30),
                      WeightSyncConfig(bucket_bytes=100))
    real = colocated.map_storage
    monkeypatch.setattr(colocated, "map_storage", lambda h: real({**h, "pid": 2**22 + 17}))
    engines.receive(1)
    with pytest.raises(Exception, match="cannot open the engine's shared weights"):
        sync.push(1).wait(timeout=60)
    engines.join()
    assert "cannot open the engine's shared weights" in str(engines.errors[0])
    monkeypatch.setattr(colocated, "map_storage", real)
    engines.receive(2)
    sync.push(2).wait(timeout=60)
    engines.join()
    assert engines.errors == [None]
    assert_holds(engines.models[0], source)
    sync.close()


def _tp2_colocated(rank, world, model_dir, port):
    import torch.distributed as dist

    with engine_on_rank0(rank, model_dir) as engine:
        chunks, spec, groups = start_learner(model_dir, tp=2, pp=1, seed=1)
        wgroups = stage_groups("127.0.0.1", port, pp_size=1, backend="gloo")
        transport = None
        if rank == 0:
            r = receiver_for(wgroups, 0)
            transport = ColocatedTransport(wgroups[0], engines=[(engine, ColocatedReceiver(r.groups, r.rank))])
        sync = WeightSync.for_learner(chunks, spec, groups, transport, WeightSyncConfig(bucket_bytes=4096))
        try:
            before, versions = engine_minus_learner(engine, chunks, spec, groups, seed=7)
            assert before > 1e-2 and versions == [0]
            for version in (1, 2):
                report = sync.push(version).wait(timeout=120)
                err, versions = engine_minus_learner(engine, chunks, spec, groups, seed=7 + version)
                assert err <= ATOL and versions == [version], f"push {version}: |engine - learner| = {err:.2e}"
                if rank == 0:
                    assert engine.weight_version == version and report.num_buckets > 10
                    assert transport.copies == report.num_buckets * version
        finally:
            sync.close()
        dist.barrier()


def test_tp2_learner_hands_weights_to_an_embedded_engine_process(model_dir):
    run_gloo(_tp2_colocated, 2, model_dir, free_port(), timeout_s=300)
