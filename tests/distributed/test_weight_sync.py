"""Weight sync: Megatron learner ranks push versions into an embedded engine in another process, and SGLang.

The end-to-end test spawns two gloo learner ranks (TP=2, then PP=2, in one launch)
that load a tiny HF model and perturb it, so that the engine (an `EmbeddedEngine`
process started from rank 0, holding the original HF weights) computes something
else until the push. After each push the engine's per-token log-probs and entropies
of sampled responses (full-vocabulary quantities: the entropy sees every logit)
equal what the learner computes for the same tokens (`score_sequences`, vocab-
parallel) within fp32 noise, and the engine's version advanced by exactly one.
The protocol tests run sender and receivers as threads of this process: bucket
boundaries, bounded snapshots, refusals, aborts, the SGLang adapter against
`sglang_mock` joined to the gloo group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import psutil
import pytest
import torch

from entr_megatron.rollout.sglang import SGLangEngine, SGLangEngineConfig, iter_flattened_buckets, unpack_flattened_bucket
from entr_megatron.rollout.weights import WeightStage
from entr_megatron.utils.spawn import free_port, free_port_range, run_gloo
from entr_megatron.weight_sync import (
    BroadcastGroup,
    BucketLayout,
    BucketTransport,
    ColocatedReceiver,
    ColocatedTransport,
    SGLangTensorTransport,
    SGLangTransport,
    WeightSync,
    WeightSyncConfig,
    WeightSyncError,
    plan_buckets,
    receiver_for,
    stage_groups,
)
from entr_megatron.weight_sync.receiver import VersionAborted

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from sglang_mock import MockSGLangServer  # noqa: E402

# Logits of a few units keep fp32 noise between HF and Megatron near 1e-6 (see test_embedded_engine).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, initializer_range=0.1)
ATOL = 1e-5
PROMPTS = [[5, 17, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 7]]


def save_model(cfg, path):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Qwen3 (q/k norms) with tied embeddings: the tied output is never sent, and with PP=2 the
    embedding comes from stage 0 while stage 1 holds a copy of it."""
    cfg = transformers.Qwen3Config(**TINY, vocab_size=128, head_dim=16, tie_word_embeddings=True)
    return save_model(cfg, tmp_path_factory.mktemp("qwen3"))


# --- in the spawned learner ranks --------------------------------------------------------------


def perturb(chunks, seed, scale=0.05):
    """A stand-in for a training step: the same noise on every rank (replicated copies stay equal),
    and with PP > 1 the last stage's copy of tied embeddings stays equal to the first stage's
    (Megatron keeps them equal by reducing their gradients over the embedding group)."""
    import torch.distributed as dist

    from entr_megatron.parallel.groups import ParallelGroups

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g))
        groups = ParallelGroups.from_megatron()
        model = chunks[0]
        if groups.pp_size > 1 and groups.embedding is not None and model.share_embeddings_and_output_weights:
            dist.broadcast(model.shared_embedding_or_output_weight(), group=groups.embedding, group_src=0)


def wait_for(predicate, timeout_s=60.0, what=""):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def engine_minus_learner(engine, chunks, spec, groups, seed):
    """Rank 0 samples 2 x 3 responses with the engine; every rank scores them with the learner.
    Returns the largest |engine - learner| over per-token log-probs and entropies, and the
    versions the engine reported."""
    import torch.distributed as dist

    from entr_megatron.learner.scoring import score_sequences
    from entr_megatron.rollout.engine import GenerateRequest, SamplingParams, generate

    payload = [None]
    if engine is not None:
        params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=seed, ignore_eos=True)
        results = generate(engine, [GenerateRequest(p, params) for p in PROMPTS], timeout_s=60)
        payload = [[(r.prompt_ids, r.output_ids, r.logprobs, r.entropy, r.versions) for r in results]]
    dist.broadcast_object_list(payload, src=0)
    samples = payload[0]
    scores = score_sequences(chunks, spec, groups, [p + o for p, o, *_ in samples])
    worst = 0.0
    for (prompt, _, logprobs, entropy, _), (lp, ent) in zip(samples, scores):
        k = len(prompt) - 1
        worst = max(worst, (torch.tensor(logprobs, dtype=torch.float64) - lp[k:].double()).abs().max().item(),
                    (torch.tensor(entropy, dtype=torch.float64) - ent[k:].double()).abs().max().item())
    return worst, sorted({v for *_, versions in samples for v in versions})


def start_learner(model_dir, tp, pp, seed):
    from entr_megatron.learner.build import build_learner_model_from_hf
    from entr_megatron.parallel.groups import initialize_model_parallel

    groups = initialize_model_parallel(tp, pp)
    chunks, spec = build_learner_model_from_hf(model_dir, groups)
    perturb(chunks, seed)
    return chunks, spec, groups


def tp2_pushes(engine, model_dir, port):
    """TP=2: a push of tiny buckets (many buckets, tensors larger than a bucket, 3 snapshot buffers),
    then a push while the engine generates (in flight)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    chunks, spec, groups = start_learner(model_dir, tp=2, pp=1, seed=1)
    wgroups = stage_groups("127.0.0.1", port, pp_size=1, backend="gloo")
    transport = BucketTransport(wgroups[0], engines=[(engine, receiver_for(wgroups, 0))]) if rank == 0 else None
    config = WeightSyncConfig(bucket_bytes=4096, max_buckets_in_flight=3)
    sync = WeightSync.for_learner(chunks, spec, groups, transport, config)
    assert sync.is_sender == (rank == 0)
    try:
        before, versions = engine_minus_learner(engine, chunks, spec, groups, seed=7)
        assert before > 1e-2 and versions == [0], f"the engine should start from other weights ({before:.2e})"

        # Version 1; the "next training step" changes the weights as soon as push returns.
        pushed = [p.detach().clone() for c in chunks for p in c.parameters()]
        handle = sync.push(1)
        perturb(chunks, seed=2)
        report = handle.wait(timeout=120)
        with torch.no_grad():
            for p, saved in zip((p for c in chunks for p in c.parameters()), pushed):
                p.copy_(saved)
        err, versions = engine_minus_learner(engine, chunks, spec, groups, seed=8)
        assert err <= ATOL and versions == [1], f"after push 1: |engine - learner| = {err:.2e}, versions {versions}"
        if rank == 0:
            assert engine.weight_version == 1 and [r.version for r in report.engines] == [1]
            assert report.num_buckets > 10 and report.peak_snapshot_bytes <= 3 * 128 * 64 * 4, report
            assert report.num_tensors == len(sent_names(spec)) and report.num_bytes == sent_bytes(spec)
            print_report(f"tp=2, 4 KiB buckets, 3 buffers (|engine - learner| {err:.1e})", report)

        # Version 2 while a long response is being generated.
        perturb(chunks, seed=2)
        rid = None
        if rank == 0:
            from entr_megatron.rollout.engine import GenerateRequest, SamplingParams

            start = engine.health().generated_tokens
            params = SamplingParams(temperature=1.0, max_new_tokens=1000, ignore_eos=True, seed=3)
            [rid] = engine.submit([GenerateRequest([3, 1, 4, 1, 5], params)])
            wait_for(lambda: engine.health().generated_tokens >= start + 5, what="first tokens")
        report = sync.push(2).wait(timeout=120)
        if rank == 0:
            assert engine.weight_version == 2 and report.engines[0].running_at_swap == 1
            after_swap = engine.health().generated_tokens
            wait_for(lambda: engine.health().generated_tokens >= after_swap + 3, what="tokens after the swap")
            engine.abort([rid])
            results = []
            wait_for(lambda: results.extend(engine.poll(timeout=0.5)) or results, what="the aborted response")
            [r] = results
            k = r.versions.index(2)
            assert 5 <= k < len(r.versions) and r.versions == [1] * k + [2] * (len(r.versions) - k), r.versions
            assert len(r.output_ids) == len(r.logprobs) == len(r.versions)
            print_report("tp=2, in flight", report)
        err, versions = engine_minus_learner(engine, chunks, spec, groups, seed=9)
        assert err <= ATOL and versions == [2], f"after push 2: |engine - learner| = {err:.2e}"
    finally:
        sync.close()


def pp2_push(engine, model_dir, port):
    """PP=2: one group per stage, both stages send at once, the engine takes the version only
    once both arrived; default 512 MiB buckets (one per stage). The parameters are borrowed
    (sent where they are): the learner changes them once `wait_borrowed` returned."""
    import torch.distributed as dist

    chunks, spec, groups = start_learner(model_dir, tp=1, pp=2, seed=4)
    wgroups = stage_groups("127.0.0.1", port, pp_size=2, backend="gloo")
    engines = [(engine, receiver_for(wgroups, 0))] if engine is not None else []  # one receiver, both stages
    config = WeightSyncConfig(snapshot="borrow", borrow_min_bytes=256)
    sync = WeightSync.for_learner(chunks, spec, groups, BucketTransport(wgroups[groups.pp_rank], engines=engines),
                                  config)
    try:
        before, _ = engine_minus_learner(engine, chunks, spec, groups, seed=5)
        assert before > 1e-2
        # At TP=1 every tensor of >= 256 B is a view of a parameter, except q/k/v (split out of linear_qkv).
        relaid = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
        sizes = [(n, t.numel() * t.element_size()) for n, t in sync.source()]
        expected_borrowed = sum(b for n, b in sizes if b >= 256 and not n.endswith(relaid))
        assert 0 < expected_borrowed < sum(b for _, b in sizes)
        pushed = [p.detach().clone() for c in chunks for p in c.parameters()]
        handle = sync.push(3)
        sync.wait_borrowed(timeout=120)
        perturb(chunks, seed=2)  # the next optimizer step
        report = handle.wait(timeout=120)
        with torch.no_grad():
            for p, saved in zip((p for c in chunks for p in c.parameters()), pushed):
                p.copy_(saved)
        assert report.sender and report.num_buckets == 1 and report.borrowed_bytes == expected_borrowed
        err, versions = engine_minus_learner(engine, chunks, spec, groups, seed=6)
        assert err <= ATOL and versions == [3], f"pp=2: |engine - learner| = {err:.2e}"
        if dist.get_rank() == 0:
            assert engine.weight_version == 3 and report.engines[0].version == 3
            print_report(f"pp=2, stage 0 (|engine - learner| {err:.1e})", report)
    finally:
        sync.close()


@contextlib.contextmanager
def engine_on_rank0(rank, model_dir):
    """A gloo learner rank's set-up: CPU compatibility, and on rank 0 an `EmbeddedEngine` process
    holding the model's original weights (None on the other ranks), shut down at the end."""
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat
    from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig

    enable_cpu_compat()
    engine = None
    if rank == 0:
        engine = EmbeddedEngine(EmbeddedEngineConfig(model_dir=model_dir, num_threads=1, update_timeout_s=120))
    try:
        yield engine
    finally:
        if engine is not None:
            engine.shutdown()


def _learner_ranks(rank, world, model_dir, ports):
    """One launch for both layouts (spawning ranks and the engine dominates the time)."""
    with engine_on_rank0(rank, model_dir) as engine:
        tp2_pushes(engine, model_dir, ports[0])
        pp2_push(engine, model_dir, ports[1])


def sent_names(spec):
    from entr_megatron import models

    return [n for n in models.hf_names(spec, "transformers") if not (spec.tie_word_embeddings and n == "lm_head.weight")]


def sent_bytes(spec):
    from entr_megatron import models

    return 4 * sum(torch.Size(models.megatron_shape(n, spec)).numel() for n in models.megatron_names(spec))


def print_report(what, r):
    e = r.engines[0] if r.engines else None
    print(f"  {what}: {r.num_bytes} B in {r.num_buckets} buckets; learner blocked {r.blocked_s * 1e3:.1f} ms "
          f"(buffer wait {r.buffer_wait_s * 1e3:.1f} ms), transfer {r.transfer_s * 1e3:.1f} ms"
          + (f", engine blocked (swap) {e.swap_s * 1e3:.2f} ms, decode steps meanwhile {e.decode_steps_during_transfer}"
             if e else ""), flush=True)


def test_tp2_and_pp2_learners_push_into_an_embedded_engine(model_dir):
    run_gloo(_learner_ranks, 2, model_dir, (free_port(), free_port_range(2)), timeout_s=300)


# --- the protocol in one process (threads) ------------------------------------------------------


class Model(torch.nn.Module):
    """Tied embeddings, a bf16 parameter, a tensor larger than the test buckets, a buffer."""

    def __init__(self, seed=None):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.out = torch.nn.Linear(8, 50, bias=False)
        self.out.weight = self.emb.weight
        self.big = torch.nn.Parameter(torch.zeros(40, 40))
        self.norm = torch.nn.Parameter(torch.ones(6, dtype=torch.bfloat16))
        self.register_buffer("scale", torch.ones(3))
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for t in self.state_dict().values():
                    t.copy_(torch.randn(t.shape, generator=g))


def named(model):
    return [(n, t) for n, t in model.state_dict().items() if n != "out.weight"]


class Engines:
    """n in-process stand-ins for engines: a WeightStage each, receiving on its own thread
    (colocated: through `ColocatedReceiver`, the shared-memory handoff)."""

    def __init__(self, groups, n, expect=None, colocated=False):
        self.groups, self.models = groups, [Model() for _ in range(n)]
        self.stages = [WeightStage(m) for m in self.models]
        self.errors: list = [None] * n
        self.expect = expect  # version the engines expect (default: what they are told)
        self.colocated = colocated

    def receive(self, version):
        def run(i):
            stage = self.stages[i]
            stage.begin(self.expect or version)
            try:
                r = receiver_for(self.groups, i, timeout_s=30)
                (ColocatedReceiver(r.groups, r.rank, r.timeout_s) if self.colocated else r).receive(stage)
                stage.finish()
                stage.swap_into()
                self.errors[i] = None
            except Exception as e:  # noqa: BLE001
                stage.discard()
                self.errors[i] = e

        self.threads = [threading.Thread(target=run, args=(i,)) for i in range(len(self.stages))]
        for t in self.threads:
            t.start()

    def join(self):
        for t in self.threads:
            t.join(timeout=60)
            assert not t.is_alive()


def assert_holds(model, source):
    for name, t in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], t, atol=0, rtol=0, msg=name)


def test_buckets_match_sglang_flattened_layout():
    tensors = [("a", torch.randn(3, 5)), ("h", torch.randn(7).bfloat16()), ("i", torch.arange(4)), ("big", torch.randn(100)),
               ("b", torch.randn(2)), ("c", torch.randn(9).half())]
    ours = list(plan_buckets(tensors, bucket_bytes=96))
    theirs = list(iter_flattened_buckets(tensors, bucket_bytes=96))
    assert [list(layout.names) for layout, _ in ours] == [b.names for b in theirs]
    assert [len(b.names) for b in theirs] == [2, 1, 1, 2] and theirs[2].names == ["big"]  # 400 B alone in its bucket
    for (layout, ts), bucket in zip(ours, theirs):
        flat = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.fill(flat, ts)
        assert torch.equal(flat, bucket.flat)
        again = BucketLayout.from_bytes(layout.to_bytes())
        assert again == layout
        for (name, view), (name2, t) in zip(again.views(flat), unpack_flattened_bucket(bucket)):
            assert name == name2 and torch.equal(view, t)
    [(layout, _)] = plan_buckets(tensors[:2], bucket_bytes=1 << 20, dtype=torch.bfloat16)
    assert layout.dtypes == (torch.bfloat16, torch.bfloat16) and layout.nbytes == 2 * (15 + 7)
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(plan_buckets(tensors, bucket_bytes=0))
    with pytest.raises(ValueError, match="WeightSyncConfig.dtype"):
        WeightSyncConfig(dtype="float33")


@pytest.mark.parametrize("bucket_bytes, buffers, chunk", [(100, 1, 64 << 20), (300, 2, 64 << 20), (512 << 20, None, 64 << 20),
                                                     (512 << 20, None, 100), (300, 2, 7)])
def test_versions_reach_two_engines_with_bounded_snapshots(bucket_bytes, buffers, chunk):
    """chunk: a bucket's bytes travel in broadcasts of this size (several per bucket, a short last one)."""
    groups = stage_groups("127.0.0.1", free_port(), pp_size=1, engine_ranks=(1, 1), backend="gloo")
    engines = Engines(groups, 2)
    config = WeightSyncConfig(bucket_bytes=bucket_bytes, max_buckets_in_flight=buffers)
    sources = {}
    sync = WeightSync(lambda: named(sources["now"]), BucketTransport(groups[0], chunk_bytes=chunk), config)
    for version in (1, 2):
        source = sources["now"] = Model(seed=version)
        engines.receive(version)
        pushed = Model(seed=version)
        handle = sync.push(version)
        with torch.no_grad():
            for p in source.parameters():  # the learner moves on: the snapshot was taken
                p.add_(1.0)
        report = handle.wait(timeout=60)
        engines.join()
        assert engines.errors == [None, None]
        for m in engines.models:
            assert_holds(m, pushed)
            assert m.out.weight is m.emb.weight
        assert report.num_tensors == 4 and report.num_bytes == 4 * (400 + 1600 + 3) + 2 * 6
        assert report.num_buckets == {100: 3, 300: 3, 512 << 20: 1}[bucket_bytes]  # norm and scale share one
        if buffers is not None:
            assert report.peak_snapshot_bytes <= buffers * 6400
    sync.close()


def test_borrowed_parameters_go_out_where_they_are_until_released():
    """snapshot="borrow": tensors of at least borrow_min_bytes are sent from the parameters
    themselves (emb 1600 B and big 6400 B; the bf16 norm and the buffer, 12 B each, are copied),
    push returns before they are sent, and the learner may change them only after wait_borrowed."""
    groups = stage_groups("127.0.0.1", free_port(), pp_size=1, engine_ranks=(1,), backend="gloo")
    assert groups[0].streams == 2  # gloo: two connections, consecutive pieces alternate
    engines = Engines(groups, 1)
    source = Model(seed=1)
    config = WeightSyncConfig(bucket_bytes=512 << 20, snapshot="borrow", borrow_min_bytes=1000)
    sync = WeightSync(lambda: named(source), BucketTransport(groups[0], chunk_bytes=512, timeout_s=30), config)
    pushed = Model(seed=1)
    handle = sync.push(1)  # no engine receives yet: the borrowed bytes cannot have left
    report = handle.report
    assert report.num_bytes == 4 * (400 + 1600 + 3) + 2 * 6 and report.borrowed_bytes == 4 * (400 + 1600)
    assert sync.pool.peak_in_use_bytes == 2 * 6 + 4 * 3  # the buffer holds the copied tensors only
    assert not handle.released()
    with pytest.raises(TimeoutError, match="still reads"):
        sync.wait_borrowed(timeout=0.3)
    engines.receive(1)
    waited = sync.wait_borrowed(timeout=60)
    assert handle.released() and waited > 0
    with torch.no_grad():
        for p in source.parameters():  # the next optimizer step
            p.add_(1.0)
    handle.wait(timeout=60)
    engines.join()
    assert engines.errors == [None]
    assert_holds(engines.models[0], pushed)
    # Version 2 goes out from the changed parameters; cast on the wire, nothing can be borrowed.
    engines.receive(2)
    report = sync.push(2).wait(timeout=60)
    engines.join()
    assert engines.errors == [None] and report.borrowed_bytes == 4 * (400 + 1600)
    assert_holds(engines.models[0], source)
    cast = WeightSync(lambda: named(source), sync.transport,  # the same group, the engine stays joined
                      WeightSyncConfig(snapshot="borrow", borrow_min_bytes=1, dtype="float64"))
    engines.receive(3)
    handle = cast.push(3)
    assert handle.report.borrowed_bytes == 0 and handle.released() and cast.wait_borrowed() == 0.0
    handle.wait(timeout=60)
    engines.join()
    assert engines.errors == [None]
    cast.close()


@pytest.mark.parametrize("colocated", [False, True])
def test_refused_and_aborted_versions_keep_the_wire_aligned(colocated):
    """colocated: the same messages, each bucket copied into the engine's shared stage."""
    groups = stage_groups("127.0.0.1", free_port(), pp_size=1, backend="gloo")
    engines = Engines(groups, 1, colocated=colocated)
    state = {"fail": False}
    source = Model(seed=1)

    def weights():
        for i, item in enumerate(named(source)):
            if state["fail"] and i == 2:
                raise RuntimeError("learner bug (test)")
            yield item

    transport = (ColocatedTransport if colocated else BucketTransport)(groups[0], timeout_s=30)
    sync = WeightSync(weights, transport, WeightSyncConfig(bucket_bytes=100))
    before = {n: t.clone() for n, t in engines.models[0].state_dict().items()}
    engines.expect = 5  # the engine was told another version than the learner sends
    engines.receive(1)
    with pytest.raises(WeightSyncError, match="1 engine rank"):
        sync.push(1).wait(timeout=60)
    engines.join()
    assert "the learner sent weight version 1" in str(engines.errors[0])
    torch.testing.assert_close(engines.models[0].state_dict(), before, atol=0, rtol=0)  # untouched
    engines.expect, state["fail"] = None, True
    engines.receive(2)
    with pytest.raises(RuntimeError, match="learner bug"):
        sync.push(2)  # the sender thread aborts the version on the wire
    engines.join()
    assert "aborted version 2" in str(engines.errors[0])
    state["fail"] = False
    engines.receive(3)
    sync.push(3).wait(timeout=60)
    engines.join()
    assert engines.errors == [None]
    assert_holds(engines.models[0], source)
    with pytest.raises(ValueError, match="must increase"):
        sync.push(3)
    sync.close()


def test_a_chunk_goes_out_as_soon_as_the_learner_copied_it():
    """The sender gets a bucket before its bytes are copied and broadcasts each chunk once the
    learner copied it: the engine holds the first chunk while the learner is still copying."""
    from entr_megatron.weight_sync.snapshot import BufferPool, SnapshotBucket

    groups = stage_groups("127.0.0.1", free_port(), pp_size=1, backend="gloo")
    tensors = [torch.randn(64), torch.randn(32)]  # 256 + 128 bytes: chunks of 128 bytes, 3 of them
    [(layout, ts)] = plan_buckets([("a", tensors[0]), ("b", tensors[1])], bucket_bytes=1 << 20)
    pool = BufferPool()
    bucket = SnapshotBucket(layout, pool.acquire(layout.nbytes), pool, filling=True)
    assert bucket.wait_filled(0)  # nothing to wait for
    expected = torch.cat([t.view(torch.uint8) for t in ts])
    go_on, received, errors = threading.Event(), [], []
    pieces = []

    def stop():  # called by the learner after each copied piece
        pieces.append(bucket._filled)
        if len(pieces) == 1:  # 128 bytes copied: hold the learner until the engine got them
            assert go_on.wait(30), "the first chunk never reached the engine"
        return False

    def learner():
        try:
            bucket.fill(ts, stop=stop, slice_bytes=128)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def engine():
        try:
            g = BroadcastGroup.join(groups[0], 1, timeout_s=30)
            flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
            for start in range(0, layout.nbytes, 128):  # the same collectives as broadcast_chunks
                g.broadcast(flat[start:start + 128])
                if start == 0:
                    received.append(flat[:128].clone())
                    go_on.set()
            received.append(flat)
            g.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            go_on.set()

    threads = [threading.Thread(target=engine), threading.Thread(target=learner)]
    for t in threads:
        t.start()
    sender = BroadcastGroup.join(groups[0], 0, timeout_s=30)
    sender.broadcast_chunks(bucket.flat, 128, ready=bucket.wait_filled)
    for t in threads:
        t.join(timeout=60)
    sender.close()
    assert errors == []
    assert pieces[0] == 128 and len(pieces) == 3  # the learner was held after its first piece
    assert torch.equal(received[0], expected[:128]) and torch.equal(received[1], expected)
    bucket.release()
    bucket.release()  # idempotent
    assert pool._in_use == 0


def test_a_bucket_the_learner_fails_to_copy_is_aborted_on_the_wire():
    """The learner fails half-way through copying a bucket the sender already announced: the
    sender sends its remaining chunks as they are, aborts the version, and the next one arrives."""
    groups = stage_groups("127.0.0.1", free_port(), pp_size=1, backend="gloo")
    engines = Engines(groups, 1)
    source = Model(seed=1)
    state = {"fail": True}

    def weights():
        for name, t in named(source):
            if state["fail"] and name == "big":
                t = torch.empty(t.shape, device="meta")  # copying it raises, after the bucket was queued
            yield name, t

    sync = WeightSync(weights, BucketTransport(groups[0], timeout_s=30, chunk_bytes=256),
                      WeightSyncConfig(bucket_bytes=512 << 20))
    before = {n: t.clone() for n, t in engines.models[0].state_dict().items()}
    engines.receive(1)
    with pytest.raises(NotImplementedError):
        sync.push(1)
    engines.join()
    assert "aborted version 1" in str(engines.errors[0])
    torch.testing.assert_close(engines.models[0].state_dict(), before, atol=0, rtol=0)  # untouched
    state["fail"] = False
    engines.receive(2)
    report = sync.push(2).wait(timeout=60)
    engines.join()
    assert engines.errors == [None] and report.num_buckets == 1
    assert_holds(engines.models[0], source)
    assert sync.pool._in_use == 0
    sync.close()


def test_a_failed_transfer_never_blocks_the_learner():
    """No engine joins: the sender fails after its timeout while the learner waits for its only
    snapshot buffer; the learner then iterates to the end without copying (TP peers gather in
    step with it), push returns, wait() raises, and the next push starts afresh."""
    groups = stage_groups("127.0.0.1", free_port(), pp_size=1, backend="gloo")
    source = Model(seed=1)
    sync = WeightSync(lambda: named(source), BucketTransport(groups[0], timeout_s=2),
                      WeightSyncConfig(bucket_bytes=100, max_buckets_in_flight=1))
    handle = sync.push(1)
    assert handle.report.num_buckets == 3 and handle.report.blocked_s < 30
    with pytest.raises(Exception, match="(?i)timed? ?out|wait"):
        handle.wait(timeout=60)
    engines = Engines(groups, 1)
    engines.receive(2)
    sync.push(2).wait(timeout=60)
    engines.join()
    assert engines.errors == [None]
    assert_holds(engines.models[0], source)
    sync.close()


_STALLS_MID_VERSION = """
import os, signal, sys
from entr_megatron.weight_sync import stage_groups
from entr_megatron.weight_sync.group import BroadcastGroup
from entr_megatron.weight_sync.receiver import next_message
groups = stage_groups("127.0.0.1", int(sys.argv[1]), pp_size=1, engine_ranks=(1, 1), backend="gloo")
group = BroadcastGroup.join(groups[0], rank=1, timeout_s=60)
next_message(group)  # the version's first bucket announced: this engine stops before its bytes
os.kill(os.getpid(), signal.SIGSTOP)
"""


class Big(torch.nn.Module):
    """One 16 MiB tensor."""

    def __init__(self, value=0.0):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((2048, 2048), value))


def test_an_engine_lost_mid_version_leaves_the_other_waiting_until_cancelled_then_it_takes_the_next():
    """Rank 1 (engine 0, another process) stops for good once the first bucket is announced. Rank 2
    (engine 1, here) waits, for bytes rank 1 was to relay or for rank 1's end-of-version
    acknowledgement, and nothing wakes it before its 60 s timeout but `cancel` (what RemotePush
    does once an engine's side failed; a member that died leaves it waiting too, seen with gloo
    for pieces from 320 kB to 64 MiB, not deterministically): the receive raises VersionAborted
    within a second, the engine keeps its weights, and joins fresh groups for the next version."""
    port = free_port_range(2)
    groups = stage_groups("127.0.0.1", port, pp_size=1, engine_ranks=(1, 1), backend="gloo")
    stalled = subprocess.Popen([sys.executable, "-c", _STALLS_MID_VERSION, str(port)])
    try:
        model = Big(0.0)
        stage = WeightStage(model)
        receiver = receiver_for(groups, 1, timeout_s=60)
        outcome = {}

        def receive(version):
            stage.begin(version)
            try:
                receiver.receive(stage)
                stage.finish()
                stage.swap_into()
                outcome[version] = None
            except Exception as e:  # noqa: BLE001
                stage.discard()
                outcome[version] = e

        waiting = threading.Thread(target=receive, args=(1,), daemon=True)
        waiting.start()
        source = Big(1.0)
        config = WeightSyncConfig(bucket_bytes=512 << 20)
        sync = WeightSync(lambda: list(source.state_dict().items()), BucketTransport(groups[0], timeout_s=60), config)
        handle = sync.push(1)
        wait_for(lambda: psutil.Process(stalled.pid).status() == psutil.STATUS_STOPPED, what="rank 1 stopped")
        waiting.join(timeout=2)
        assert waiting.is_alive()  # rank 2 waits
        t0 = time.monotonic()
        receiver.cancel()
        waiting.join(timeout=10)
        cancelled_s = time.monotonic() - t0
        assert not waiting.is_alive() and cancelled_s < 1.0, cancelled_s
        assert isinstance(outcome[1], VersionAborted) and "cancelled" in str(outcome[1])
        assert torch.count_nonzero(model.w) == 0  # the engine kept the weights it held
    finally:
        stalled.kill()
    assert stalled.wait(timeout=60) == -signal.SIGKILL
    with pytest.raises(Exception):  # the sender's side fails once rank 1 is gone
        handle.wait(timeout=60)
    sync.close()

    # the next version, over fresh groups (the lost engine's left out)
    groups = stage_groups("127.0.0.1", free_port_range(2), pp_size=1, engine_ranks=(1,), backend="gloo")
    receiver = receiver_for(groups, 0, timeout_s=60)
    again = threading.Thread(target=receive, args=(2,), daemon=True)
    again.start()
    source = Big(2.0)
    sync = WeightSync(lambda: list(source.state_dict().items()), BucketTransport(groups[0], timeout_s=60), config)
    sync.push(2).wait(timeout=60)
    again.join(timeout=60)
    assert outcome[2] is None and torch.equal(model.w, source.w.detach())
    sync.close()


class GlooRanks:
    """Makes a MockSGLangServer join the weight group with its tp_size ranks and receive each bucket
    as SGLang does (one flat broadcast, unpacked by names/dtypes/shapes)."""

    def __init__(self, server):
        self.server, self.groups, self.received = server, [], {}
        server.on_init_group, server.on_update_weights, server.on_destroy_group = self.init, self.update, self.destroy

    def _on_each_rank(self, fn, n):
        out, threads = [None] * n, []
        for i in range(n):
            threads.append(threading.Thread(target=lambda i=i: out.__setitem__(i, fn(i))))
            threads[-1].start()
        for t in threads:
            t.join(timeout=30)
        return out

    def init(self, p):
        from entr_megatron.weight_sync.group import WeightGroup

        spec = WeightGroup(p["master_address"], p["master_port"], p["world_size"], p["group_name"], p["backend"], ())
        self.groups = self._on_each_rank(lambda i: BroadcastGroup.join(spec, p["rank_offset"] + i, timeout_s=30),
                                         self.server.tp_size)

    def update(self, p):
        from entr_megatron.rollout.sglang import FlatBucket

        assert p["load_format"] == "flattened_bucket"
        dtypes = [getattr(torch, d) for d in p["dtypes"]]
        nbytes = sum(torch.Size(s).numel() * d.itemsize for s, d in zip(p["shapes"], dtypes))

        def recv(i):
            flat = torch.empty(nbytes, dtype=torch.uint8)
            self.groups[i].broadcast(flat)
            return flat

        for flat in self._on_each_rank(recv, len(self.groups)):
            self.received.update(unpack_flattened_bucket(FlatBucket(p["names"], p["dtypes"], p["shapes"], flat)))

    def destroy(self, p):
        for g in self.groups:
            g.close()


def sglang_mock_engine(a, b) -> SGLangEngine:
    """An SGLangEngine over two mock servers, with 300-byte float32 buckets (3 a version of Model)."""
    return SGLangEngine(SGLangEngineConfig(urls=(a.url, b.url), weight_bucket_bytes=300, weight_dtype="float32",
                                           kv_on_update="keep", request_timeout_s=10, weight_update_timeout_s=30))


def push_mid_generation(engine, server, sync, version):
    """Starts a 1000-token request (5 s at 5 ms a token: the update lands mid-generation even on a
    loaded machine), pushes `version` once it has 5 tokens; the push's report."""
    from entr_megatron.rollout.engine import GenerateRequest, SamplingParams

    engine.submit([GenerateRequest([5], SamplingParams(max_new_tokens=1000))])
    wait_for(lambda: server.live and len(next(iter(server.live.values())).output_ids) >= 5, what="tokens")
    return sync.push(version).wait(timeout=60)


def the_response_switches_versions(engine, version):
    """The one response: version - 1 up to a token k >= 5, `version` after."""
    results = []
    wait_for(lambda: results.extend(engine.poll(timeout=0.5)) or results, what="the response")
    [r] = results
    k = r.versions.index(version)
    assert 5 <= k < 1000 and r.versions == [version - 1] * k + [version] * (1000 - k)


def test_sglang_adapter_drives_the_handshake_over_gloo():
    with MockSGLangServer(tp_size=2, token_delay_s=0.005) as a, MockSGLangServer(tp_size=1) as b:
        ranks = [GlooRanks(a), GlooRanks(b)]
        engine = sglang_mock_engine(a, b)
        transport = SGLangTransport(engine, "127.0.0.1", free_port(), backend="gloo", timeout_s=30)
        with pytest.raises(ValueError, match="bucket_bytes"):
            WeightSync(lambda: [], transport, WeightSyncConfig())
        config = WeightSyncConfig(bucket_bytes=300, dtype="float32", max_buckets_in_flight=2)
        source = Model(seed=3)
        sync = WeightSync(lambda: named(source), transport, config)
        report = push_mid_generation(engine, a, sync, 1)
        assert engine.weight_version == 1 and report.engines[0].version == 1 and report.num_buckets == 3
        assert report.num_bytes == 4 * (400 + 1600 + 3 + 6)  # the bf16 norm travels as float32
        for r in ranks:  # every rank of both servers received every tensor, cast to float32
            assert set(r.received) == {"emb.weight", "norm", "big", "scale"}
            for name, t in named(source):
                torch.testing.assert_close(r.received[name], t.float(), atol=0, rtol=0)
        for s in (a, b):
            updates = s.calls_to("/update_weights_from_distributed")
            assert len(updates) == 3 and [u["weight_version"] for u in updates] == [None, None, "1"]
        the_response_switches_versions(engine, 1)
        # Borrowed: emb and big go to the engine's packing straight from the parameters.
        borrow = WeightSync(lambda: named(source), transport,
                            dataclasses.replace(config, snapshot="borrow", borrow_min_bytes=1000))
        source = Model(seed=4)
        report = borrow.push(2).wait(timeout=60)
        assert engine.weight_version == 2 and report.borrowed_bytes == 4 * (400 + 1600)
        for r in ranks:
            for name, t in named(source):
                torch.testing.assert_close(r.received[name], t.float(), atol=0, rtol=0)
        assert [u["weight_version"] for u in a.calls_to("/update_weights_from_distributed")][3:] == [None, None, "2"]
        sync.close()
        assert a.calls_to("/destroy_weights_update_group") and not a.groups
        engine.shutdown()


def test_sglang_servers_on_this_host_load_each_bucket_from_shared_memory():
    """rollout.placement colocated with SGLang: no weight group; the snapshot's buffers lie in shared
    memory, and each bucket goes where it lies (no copy of ours) as one /update_weights_from_tensor
    per server, a payload per TP rank."""
    with MockSGLangServer(tp_size=2, token_delay_s=0.005) as a, MockSGLangServer(tp_size=1) as b:
        held, files = {}, set()  # what each server loaded; the shared-memory files it read them from

        def load(named, body, h):
            h.update((n, t.clone()) for n, t in named)
            files.update(t.untyped_storage()._share_filename_cpu_()[1] for _, t in named)

        for server in (a, b):
            held[server.url] = {}
            server.on_update_tensors = partial(load, h=held[server.url])
        engine = sglang_mock_engine(a, b)
        transport = SGLangTensorTransport(engine)
        config = WeightSyncConfig(bucket_bytes=300, dtype="float32", max_buckets_in_flight=2)
        source = Model(seed=3)
        sync = WeightSync(lambda: named(source), transport, config)
        report = push_mid_generation(engine, a, sync, 1)
        assert engine.weight_version == 1 and report.engines[0].version == 1 and report.num_buckets == 3
        assert report.num_bytes == 4 * (400 + 1600 + 3 + 6)  # the bf16 norm travels as float32
        for server in (a, b):
            assert set(held[server.url]) == {"emb.weight", "norm", "big", "scale"}
            for name, t in named(source):
                torch.testing.assert_close(held[server.url][name], t.float(), atol=0, rtol=0)
            updates = server.calls_to("/update_weights_from_tensor")
            assert [u["weight_version"] for u in updates] == [None, None, "1"]
            assert all(len(u["serialized_named_tensors"]) == server.tp_size for u in updates)
            assert not server.calls_to("/init_weights_update_group") and not server.calls_to("/update_weights_from_distributed")
            assert len(server.calls_to("/begin_weight_update")) == len(server.calls_to("/end_weight_update")) == 1
        the_response_switches_versions(engine, 1)
        # the servers read the snapshot's own buffers: nothing was packed again
        snapshot = {b.tensor.untyped_storage()._share_filename_cpu_()[1] for b in sync.pool._free}
        assert files and files <= snapshot and transport.updates._pack_buffers == []
        # the next version goes through the same shared buffers, with the new values
        files.clear()
        source = Model(seed=4)
        sync.push(2).wait(timeout=60)
        assert files and files <= snapshot
        for name, t in named(source):
            torch.testing.assert_close(held[b.url][name], t.float(), atol=0, rtol=0)
        sync.close()
        engine.shutdown()
