"""Benchmark: per-token log-prob + entropy from vocab-sharded logits.

Compares, on spawned gloo ranks (TP = 1, 2, ...), forward-only and forward+backward:

  (a) gather   all-gather the full logits, then log_softmax + entropy (the baseline)
  (b) megatron Megatron's vocab_parallel_cross_entropy plus a separate unfused
               vocab-parallel entropy (Megatron's CE overwrites its input with the
               softmax, so it gets a clone of the shard: the entropy needs the logits)
  (c) ours     entr_megatron.parallel.vocab_parallel_logprobs_entropy

and prints each one's peak-memory increase and time as ratios against (a)
measured in the same run. Memory is the process's peak resident set size above
its level before the call (Linux VmHWM, reset through /proc/self/clear_refs),
per rank, maximum over ranks; large allocations are forced to mmap so freed
memory leaves the resident set. Time is the median over repeats of the slowest
rank.

    python tools/bench_vocab_parallel.py                      # the issue's sizes, TP=1 and TP=2
    python tools/bench_vocab_parallel.py --tp 2 --sizes 4096x65536 --repeats 5
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import gc
import os
import statistics
import sys
import time

# Freed memory must leave the resident set for peak-RSS deltas to mean anything:
# with a fixed threshold glibc mmaps every allocation >= 128 KiB and unmaps it on free.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))

import torch
import torch.distributed as dist

from entr_megatron.parallel import vocab_parallel_logprobs_entropy
from entr_megatron.utils.spawn import run_gloo

METHODS = ("gather", "megatron", "ours")
MODES = ("fwd", "fwd+bwd")


# ---- memory accounting -------------------------------------------------------

_LIBC = ctypes.CDLL("libc.so.6")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Returns the current RSS (bytes) after resetting the peak to it."""
    gc.collect()
    _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


# ---- the three methods -------------------------------------------------------


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the vocab dim; backward keeps this rank's slice (the loss is replicated)."""

    @staticmethod
    def forward(ctx, shard, group):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.rank, ctx.width = rank, shard.shape[-1]
        if world == 1:
            return shard.clone()
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous(), None


def gather_then_softmax(logits, targets, group):
    full = _GatherLastDim.apply(logits, group)
    logp = torch.log_softmax(full.float(), dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def megatron_ce_plus_entropy(logits, targets, group):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    x = logits.float()
    m = x.detach().amax(-1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = x - m
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(-1, keepdim=True))
    p = exp / sum_exp
    logp = shifted - sum_exp.log()
    ent = -reduce_from_tensor_model_parallel_region((p * logp).sum(-1))
    lp = -vocab_parallel_cross_entropy(logits.clone(), targets)
    return lp, ent


def ours(logits, targets, group, chunk_size=None):
    return vocab_parallel_logprobs_entropy(logits, targets, group=group, chunk_size=chunk_size)


# ---- one measurement ---------------------------------------------------------


def run_once(method, mode, logits, targets, g_lp, g_h, group, chunk_size):
    fn = {"gather": gather_then_softmax, "megatron": megatron_ce_plus_entropy,
          "ours": lambda x, t, g: ours(x, t, g, chunk_size)}[method]
    if mode == "fwd":
        with torch.no_grad():
            lp, ent = fn(logits, targets, group)
        return
    x = logits.detach().requires_grad_()
    lp, ent = fn(x, targets, group)
    (lp * g_lp + ent * g_h).sum().backward()
    assert x.grad is not None and x.grad.shape == logits.shape


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(rank, world, sizes, dtype_name, repeats, chunk_size, results_path):
    import warnings

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    dtype = getattr(torch, dtype_name)
    rows = []
    for n_tokens, vocab in sizes:
        shard = vocab // world
        gen = torch.Generator().manual_seed(1234)
        logits = (torch.randn(n_tokens, vocab, generator=gen) * 2)[:, rank * shard:(rank + 1) * shard].to(dtype).contiguous()
        targets = torch.randint(0, vocab, (n_tokens,), generator=gen)
        g_lp, g_h = torch.randn(n_tokens, generator=gen), torch.randn(n_tokens, generator=gen)
        gc.collect()
        for mode in MODES:
            for method in METHODS:
                dist.barrier()
                base = reset_peak()
                run_once(method, mode, logits, targets, g_lp, g_h, group, chunk_size)
                mem = _max_over_ranks(peak_rss() - base)
                times = []
                for _ in range(repeats):
                    gc.collect()
                    dist.barrier()
                    t0 = time.perf_counter()
                    run_once(method, mode, logits, targets, g_lp, g_h, group, chunk_size)
                    times.append(_max_over_ranks(time.perf_counter() - t0))
                rows.append((world, n_tokens, vocab, mode, method, mem, statistics.median(times)))
                if rank == 0:
                    print(f"  tp={world} {n_tokens}x{vocab} {mode:7s} {method:8s} "
                          f"mem +{mem / 2**20:8.1f} MiB  time {statistics.median(times):7.3f} s", flush=True)
    if rank == 0:
        with open(results_path, "a") as f:
            for row in rows:
                f.write(repr(row) + "\n")
    parallel_state.destroy_model_parallel()


def print_table(rows):
    print()
    print("| TP | tokens x vocab | pass | method | peak mem increase | mem / (a) | time | time / (a) |")
    print("|---|---|---|---|---|---|---|---|")
    base = {(r[0], r[1], r[2], r[3]): r for r in rows if r[4] == "gather"}
    for world, n, v, mode, method, mem, t in rows:
        b = base[(world, n, v, mode)]
        print(f"| {world} | {n} x {v} | {mode} | {method} | {mem / 2**20:.0f} MiB | "
              f"{mem / b[5]:.3f}x | {t:.3f} s | {t / b[6]:.3f}x |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (one launch each)")
    ap.add_argument("--sizes", nargs="+", default=["4096x65536", "2048x151936"], help="TOKENSxVOCAB")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=None, help="ours: tokens per chunk (default: auto)")
    args = ap.parse_args(argv)
    try:
        sizes = [tuple(int(x) for x in s.lower().split("x")) for s in args.sizes]
    except ValueError:
        ap.error(f"--sizes takes TOKENSxVOCAB, e.g. 4096x65536; got {args.sizes}")
    for tp in args.tp:
        bad = [v for _, v in sizes if v % tp]
        if bad:
            ap.error(f"vocabulary sizes {bad} are not divisible by --tp {tp}")
    results = f"/tmp/bench_vocab_parallel.{os.getpid()}.txt"
    open(results, "w").close()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, dtype {args.dtype}, repeats {args.repeats}")
    for tp in args.tp:
        print(f"TP={tp}: {tp} gloo rank(s), {max(1, (os.cpu_count() or 1) // tp)} thread(s) each", flush=True)
        run_gloo(worker, tp, sizes, args.dtype, args.repeats, args.chunk_size, results, timeout_s=3600)
    with open(results) as f:
        rows = [ast.literal_eval(line) for line in f if line.strip()]
    os.unlink(results)
    print_table(rows)


if __name__ == "__main__":
    sys.exit(main())
