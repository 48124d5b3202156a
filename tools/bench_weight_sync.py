"""Weight-sync throughput against a bare gloo broadcast of one flat buffer, same processes, same run.

    python tools/bench_weight_sync.py                       # ~1.05 GB fp32 Llama-shaped model
    python tools/bench_weight_sync.py --snapshot borrow --bucket-mb 512 --chunk-mb 64 256 --buffers 0 4 --reps 3
    python tools/bench_weight_sync.py --placement separate colocated --snapshot borrow --bucket-mb 512   # handoff vs broadcast

Two processes: the learner (a Megatron GPTModel at TP=1 on one gloo rank, randomly
initialised from a Llama config written here, no HF hub) and a real `EmbeddedEngine`
(HF transformers, fp32, its own process, random init from the same config). Both
join one weight group over 127.0.0.1 (gloo, `GLOO_STREAMS` connections). Each
repetition times, in turn:

* weight sync: `WeightSync.push(v)` -> `handle.wait()`: gathers (none at TP=1), HF names,
  per bucket its header, then its bytes in pieces of at most `--chunk-mb`
  (`BucketLayout.ranges`), several in flight: with `--snapshot borrow` parameters go
  out from where they are and the rest (the re-laid-out QKV, tensors under
  `--borrow-min-mb`) is copied first; with `copy` everything is copied into host
  buffers, each piece sent as soon as it is copied. The engine receives straight into
  its staging copy (`WeightStage.bucket_buffer`: no copy on its side), acknowledges,
  then swaps the version in. Time = `transfer_s` (push call until every engine rank
  holds the version).
* colocated handoff (`--placement colocated`, `rollout.placement: colocated`): the same push
  through `ColocatedTransport` on a second group: per bucket the engine answers with a handle
  to its staging copy in shared memory and the learner copies the bucket there itself (the
  only copy of a borrowed parameter; "copies" counts the bucket copies into engine memory).
* bare: the same bytes as ONE flat uint8 buffer, prepared beforehand, in one
  broadcast on the same group, then the same one-integer acknowledgement. (The engine
  then loads that buffer too, untimed, so every repetition installs a real version.)
  This is the baseline of "vs bare".
* bare pieces: the same buffer in `--chunk-mb` pieces, pipelined over the group's
  streams (`broadcast_chunks`): what the transport itself can do with pieces, no
  weights involved (a context row: the weight sync's overhead over it is ours).

Two more context rows: the bare broadcast until the engine has copied it into its
staging copy (what a receiver that copies each bucket into the engine's `WeightStage`
costs at least), and the learner's copy of the model into a warm host buffer alone
(what a full snapshot costs).

The first push and the first bare broadcasts warm up (page faults of fresh buffers)
and are not counted; the table gives medians over `--reps`. Learner blocked =
`push` call duration; engine blocked = the swap (`WeightUpdateReport.swap_s`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from entr_megatron.rollout.engine import WeightReceiver  # noqa: E402
from entr_megatron.rollout.weights import WeightBucket  # noqa: E402
from entr_megatron.utils.spawn import free_port, run_gloo  # noqa: E402
from entr_megatron.weight_sync.buckets import BucketLayout, plan_buckets  # noqa: E402
from entr_megatron.weight_sync.group import WeightGroup  # noqa: E402
from entr_megatron.weight_sync.receiver import joined_group  # noqa: E402

GB = 1e9


def llama_config(args) -> dict:
    return dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=args.vocab, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
        initializer_range=0.02, torch_dtype="float32",
    )


_BASELINE_BUFFER: list[torch.Tensor] = []  # the engine process keeps its receive buffer between repetitions


@dataclass(frozen=True)
class OneBufferReceiver(WeightReceiver):
    """Engine side of the bare baseline: one broadcast into one flat buffer, the acknowledgement,
    then (untimed by the learner) the buffer into the stage so the version is real."""

    group: WeightGroup
    rank: int
    layout: BucketLayout
    chunk_bytes: int = 0
    """> 0: the buffer in pieces of this size, pipelined over the group's streams (`broadcast_chunks`)."""

    def receive(self, stage) -> None:
        g = joined_group(self.group, self.rank)
        if not _BASELINE_BUFFER or _BASELINE_BUFFER[0].numel() != self.layout.nbytes:
            _BASELINE_BUFFER[:] = [torch.empty(self.layout.nbytes, dtype=torch.uint8)]
        flat = _BASELINE_BUFFER[0]
        if self.chunk_bytes > 0:
            g.broadcast_chunks(flat, self.chunk_bytes)
        else:
            g.broadcast(flat)
        g.all_reduce_sum(0)
        stage.load_bucket(WeightBucket(self.layout.entries(), flat))


def _learner(rank, world, args, model_dir, port):
    from entr_megatron.learner.build import build_learner_model_from_hf
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat
    from entr_megatron.parallel.groups import initialize_model_parallel
    from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from entr_megatron.weight_sync import BucketTransport, WeightSync, WeightSyncConfig, receiver_for, stage_groups
    from entr_megatron.weight_sync.colocated import ColocatedReceiver, ColocatedTransport

    enable_cpu_compat()
    t0 = time.perf_counter()
    groups = initialize_model_parallel(1, 1)
    chunks, spec = build_learner_model_from_hf(os.path.join(model_dir, "config.json"), groups, load_weights=False)
    print(f"learner built in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    engine = EmbeddedEngine(EmbeddedEngineConfig(
        model_dir=model_dir, init="random", num_threads=args.threads, update_timeout_s=1200, startup_timeout_s=1200,
        rpc_timeout_s=300,
    ))
    print(f"engine started in {time.perf_counter() - t0:.0f} s", flush=True)
    wgroups = stage_groups("127.0.0.1", port, pp_size=1, backend="gloo")
    transport = BucketTransport(wgroups[0], engines=[(engine, receiver_for(wgroups, 0))], timeout_s=1200)
    cgroups = stage_groups("127.0.0.1", free_port(), pp_size=1, backend="gloo")  # the colocated handoff's own group
    colocated = ColocatedTransport(cgroups[0], engines=[(engine, ColocatedReceiver(cgroups, 1, 1200))], timeout_s=1200)
    transports = {"separate": transport, "colocated": colocated}
    rows, version = [], 0
    try:
        # The bare baseline's buffer: this stage's HF tensors packed once, as one bucket.
        [(layout, tensors)] = plan_buckets(_hf_weights(chunks, spec, groups), bucket_bytes=1 << 62)
        flat = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.fill(flat, tensors)
        total = layout.nbytes
        print(f"model: {sum(torch.Size(s).numel() for s in layout.shapes) / 1e6:.1f} M parameters, "
              f"{total / GB:.3f} GB fp32, {len(layout.names)} tensors", flush=True)

        def bare(chunk_bytes: int = 0) -> tuple[float, float]:
            """(one broadcast + acknowledgement, the same until the engine copied it into its stage);
            chunk_bytes > 0: the buffer in pieces instead of one broadcast."""
            nonlocal version
            version += 1
            receiver, out = OneBufferReceiver(wgroups[0], 1, layout, chunk_bytes), []
            t_call = time.time()
            call = threading.Thread(target=lambda: out.append(engine.update_weights(receiver, version)))
            call.start()
            time.sleep(0.05)  # the engine's receiver is waiting: time the wire, not the call
            transport.connect()  # joined by the first push unless only colocated pushes ran
            t_wire = time.time()
            t = time.perf_counter()
            if chunk_bytes > 0:
                transport.group.broadcast_chunks(flat, chunk_bytes)
            else:
                transport.group.broadcast(flat)
            transport.group.all_reduce_sum(0)
            seconds = time.perf_counter() - t
            call.join()
            assert engine.weight_version == version
            return seconds, out[0].transfer_s - (t_wire - t_call)

        def copy_alone() -> float:
            """The learner's copy of the whole model into a warm host buffer (what a snapshot costs alone)."""
            t = time.perf_counter()
            layout.fill(scratch, tensors)
            return time.perf_counter() - t

        scratch = torch.empty_like(flat)
        copies = [copy_alone() for _ in range(args.reps + 1)][1:]
        del scratch
        bares, loads = [], []
        for placement, snapshot, chunk_mb, bucket_mb, buffers in itertools.product(
                args.placement, args.snapshot, args.chunk_mb, args.bucket_mb, args.buffers):
            pushing = transports[placement]
            pushing.chunk_bytes = chunk_mb << 20
            config = WeightSyncConfig(bucket_bytes=bucket_mb << 20, max_buckets_in_flight=buffers or None,
                                      snapshot=snapshot, borrow_min_bytes=args.borrow_min_mb << 20)
            sync = WeightSync.for_learner(chunks, spec, groups, pushing, config)
            copies_before = colocated.copies  # bucket copies into the engine's memory
            reports, paired, piecewise = [], [], []
            for rep in range(args.reps + 1):
                version += 1
                report = sync.push(version).wait()
                assert engine.weight_version == version and report.num_bytes == total
                wire, load = bare()
                pieces = bare(chunk_mb << 20)[0]
                if args.verbose:
                    print(f"    rep {rep}: sync {report.transfer_s:.3f} s (learner blocked {report.blocked_s:.3f} s), "
                          f"bare {wire:.3f} s, bare pieces {pieces:.3f} s", flush=True)
                if rep:  # the first of each: warm-up (fresh buffers fault their pages in)
                    reports.append(report)
                    paired.append(wire)
                    piecewise.append(pieces)
                    bares.append(wire)
                    loads.append(load)
            sync.pool.clear()
            handoff = (colocated.copies - copies_before) / (args.reps + 1) if placement == "colocated" else None
            rows.append((placement, snapshot, chunk_mb, bucket_mb, buffers, reports, paired, piecewise, handoff))
            med = statistics.median
            print(f"  {placement}: snapshot {snapshot}, chunk {chunk_mb} MiB, bucket {bucket_mb} MiB, buffers {buffers or 'all'}: "
                  f"sync {med(r.transfer_s for r in reports):.3f} s, bare {med(paired):.3f} s", flush=True)
    finally:
        transport.close()
        colocated.close()
        engine.shutdown()
    _table(rows, total, bares, loads, copies, args, wgroups[0].streams)


def _hf_weights(chunks, spec, groups):
    from entr_megatron.learner.hf_export import iter_hf_weights

    return iter_hf_weights(chunks, spec, groups, layout="transformers")


def _table(rows, total, bares, loads, copies, args, streams):
    med = statistics.median
    bare_s = med(bares)
    print()
    print(f"weight sync, {total / GB:.3f} GB fp32 Llama-shaped model ({args.layers} layers, hidden {args.hidden}, "
          f"vocab {args.vocab}), learner Megatron TP=1 -> EmbeddedEngine process, gloo over 127.0.0.1, "
          f"median of {args.reps}, {os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print("| transfer | snapshot | bucket | chunk | snapshot buffers | buckets | borrowed | peak snapshot | copies into "
          "the engine per version | time (s) | GB/s | vs bare | learner blocked (s) | engine blocked (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| bare gloo broadcast, one flat buffer | - | - | - | - | 1 | - | - | - | {bare_s:.3f} | {total / bare_s / GB:.2f} "
          "| 1.00 | - | - |")
    for placement, snapshot, chunk_mb, bucket_mb, buffers, reports, paired, piecewise, handoff in rows:
        t = med(r.transfer_s for r in reports)
        ratio = med(b / r.transfer_s for r, b in zip(reports, paired))  # each with the bare run next to it
        what = "weight sync (broadcast)" if placement == "separate" else "colocated handoff (shared memory)"
        print(f"| {what} | {snapshot} | {bucket_mb} MiB | {chunk_mb} MiB | {buffers or 'all'} | {reports[0].num_buckets} "
              f"| {reports[0].borrowed_bytes / total:.0%} | {reports[0].peak_snapshot_bytes / GB:.3f} GB "
              f"| {'-' if handoff is None else f'{handoff:.0f} buckets'} | {t:.3f} "
              f"| {total / t / GB:.2f} | {ratio:.2f} | {med(r.blocked_s for r in reports):.3f} | "
              f"{med(r.engine_blocked_s for r in reports):.4f} |")
    by_chunk: dict[int, list[tuple[float, float]]] = {}
    for _, _, chunk_mb, _, _, _, paired, piecewise, _ in rows:
        by_chunk.setdefault(chunk_mb, []).extend(zip(paired, piecewise))
    for chunk_mb, pairs in by_chunk.items():
        t = med(p for _, p in pairs)
        print(f"| (context) bare, the same buffer in {chunk_mb} MiB pieces over the group's {streams} gloo streams "
              f"| - | - | {chunk_mb} MiB | - | 1 | - | - | - | {t:.3f} | {total / t / GB:.2f} | "
              f"{med(b / p for b, p in pairs):.2f} | - | - |")
    print(f"| (context) bare broadcast, then the engine copies it into its stage | - | - | - | - | 1 | - | - | - | "
          f"{med(loads):.3f} | {total / med(loads) / GB:.2f} | {bare_s / med(loads):.2f} | - | - |")
    print(f"| (context) the learner's copy of the model into a warm buffer, alone | - | - | - | - | - | - | - | - | "
          f"{med(copies):.3f} | {total / med(copies) / GB:.2f} | - | - | - |")
    print("(vs bare: per repetition, bare time / sync time of the runs next to each other; goal >= 0.8)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=36000)
    p.add_argument("--bucket-mb", type=int, nargs="+", default=[512, 64])
    p.add_argument("--chunk-mb", type=int, nargs="+", default=[64],
                   help="MiB per broadcast of a bucket's data (>= the bucket: one broadcast per bucket, sent once copied)")
    p.add_argument("--buffers", type=int, nargs="+", default=[0], help="snapshot buffers (0: all, one copy of the model)")
    p.add_argument("--snapshot", nargs="+", default=["borrow", "copy"], choices=["borrow", "copy"],
                   help="WeightSyncConfig.snapshot: parameters sent where they are, or every tensor copied first")
    p.add_argument("--borrow-min-mb", type=int, default=1, help="WeightSyncConfig.borrow_min_bytes, in MiB")
    p.add_argument("--placement", nargs="+", default=["separate"], choices=["separate", "colocated"],
                   help="rollout.placement: broadcast over the weight group, or the colocated shared-memory handoff")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--verbose", action="store_true", help="print every repetition")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as model_dir:
        import json

        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(llama_config(args), f)
        run_gloo(_learner, 1, args, model_dir, free_port(), timeout_s=3600, threads=args.threads)


if __name__ == "__main__":
    main()
