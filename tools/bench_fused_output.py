"""Benchmark: output layer + per-token log-prob and entropy, forward+backward, on gloo ranks.

Each rank holds the full hidden states ``[N, h]`` and its ``[V/tp, h]`` shard of the
output layer; every method returns per-token log-probs and entropies and gradients
to both inputs (the hidden gradient is each rank's partial sum, left un-reduced by
all methods alike):

  (a) gather    hidden @ W_r^T, all-gather the full logits, log_softmax + entropy
  (b) unfused   hidden @ W_r^T, then entr_megatron's vocab_parallel_logprobs_entropy
  (c) fused     entr_megatron's vocab_parallel_linear_logprobs_entropy (no logits), its
                default backend: the Triton kernels on CUDA, the chunked PyTorch path on CPU
  (c) fused_torch  on CUDA only: the same op forced onto its chunked PyTorch path
  (d) fused_loss  the policy loss fused into the output layer (vocab_parallel_linear_fused_loss,
                PyTorch path): ENTR with PPO-clip against mu, token-mean, its gradients computed
                in the forward pass (3 GEMMs); backward only scales them
  (d) unfused_loss  (b) followed by the same loss on its log-probs: (d)'s like-for-like baseline
  (c') liger / cce  on CUDA only, if importable: Liger's fused linear cross-entropy and
                Cut Cross-Entropy (its defaults, gradient filtering on), log-prob only, on
                this rank's shard alone (a local softmax: a speed/memory reference, not the
                same result)
  (c') liger_ent / cce_ent  the same with the entropy added unfused (this shard's logits
                materialised once more), which is what an RL loss on them needs

Printed as ratios against (b) measured in the same run. Memory: the peak increase
over the call, per rank, maximum over ranks; on CPU the resident set's high-water
mark (Linux VmHWM, reset through /proc/self/clear_refs, large allocations forced to
mmap so freed memory leaves it, as tools/bench_vocab_parallel.py), on CUDA
max_memory_allocated. "act" is that increase less the input gradients every method
must return (grad hidden + grad W, which a trainer keeps in its grad buffers anyway).
Time: per repeat the slowest rank; median and range over repeats, the methods
interleaved within each repeat so that load drifts hit them alike.

GEMM equivalents: each method's median time over that of ONE output-layer GEMM
``[N, h] x [h, V/tp]`` (torch.mm into a buffer allocated beforehand, timed in the same
repeats). (b) runs 3 such GEMMs (forward, two gradients), the fused op 4 (its backward
recomputes the logits), fused_loss 3 (the "GEMMs run" column), so "GEMM efficiency" = GEMMs run x
GEMM time / the method's time is the fraction of the matmul throughput (cuBLAS on CUDA, BLAS on CPU)
that the method's own FLOPs imply.

    python tools/bench_fused_output.py                     # 4096 tokens x h 2048 x V 65536, TP=2
    python tools/bench_fused_output.py --small             # a quick run
    python tools/bench_fused_output.py --tokens 2048 --hidden 1024 --vocab 32768 --tp 1 2 --repeats 5
    python tools/bench_fused_output.py --methods unfused fused_loss   # the fused policy loss against (b)
"""

from __future__ import annotations

import argparse
import ast
import gc
import os
import statistics
import sys
import time

# Freed memory must leave the resident set for peak-RSS deltas to mean anything
# (the spawned ranks inherit this before their allocator starts).
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))

import torch
import torch.distributed as dist

from bench_vocab_parallel import gather_then_softmax, peak_rss, reset_peak  # tools/ is sys.path[0]
from entr_megatron.parallel import vocab_parallel_linear_logprobs_entropy, vocab_parallel_logprobs_entropy
from entr_megatron.parallel.fused_output import triton_available
from entr_megatron.parallel.fused_output_loss import GEMMS_PER_PASS, vocab_parallel_linear_fused_loss
from entr_megatron.utils.spawn import run_gloo

BASELINE = "unfused"


# ---- the methods: (hidden, weight shard, targets, group, tile) -> (logprobs, entropy or None) ----


def gather_full_logits(x, w, targets, group, tile):
    return gather_then_softmax(x @ w.t(), targets, group)


def unfused(x, w, targets, group, tile):
    return vocab_parallel_logprobs_entropy(x @ w.t(), targets, group=group)


def fused(x, w, targets, group, tile):
    return vocab_parallel_linear_logprobs_entropy(x, w, targets, group=group, chunk_tokens=tile[0], chunk_vocab=tile[1])


def fused_torch(x, w, targets, group, tile):
    return vocab_parallel_linear_logprobs_entropy(
        x, w, targets, group=group, chunk_tokens=tile[0], chunk_vocab=tile[1], backend="torch"
    )


# The per-token inputs of the RL loss (mu, advantages), set by `worker` for the loss methods.
_LOSS_INPUTS: dict = {}


def _entr_ppo_rows(s, e, logprob_n, entropy_n):
    """ENTR (learner entropy) + PPO-clip against mu, token-mean: each token its own one-token row,
    as the learner runs it (learner/fused_output.py)."""
    from entr_megatron.algorithm import policy_loss_terms

    blp, adv, cfg = _LOSS_INPUTS["blp"][s:e, None], _LOSS_INPUTS["adv"][s:e], _LOSS_INPUTS["cfg"]
    mask = torch.ones_like(blp, dtype=torch.bool)
    return policy_loss_terms(logprob_n[:, None], entropy_n[:, None], blp, adv, mask, cfg).loss_BT[:, 0]


def fused_loss(x, w, targets, group, tile):
    return vocab_parallel_linear_fused_loss(x, w, targets, _entr_ppo_rows, group=group, chunk_tokens=tile[0])[0]


def unfused_loss(x, w, targets, group, tile):
    from entr_megatron.algorithm import policy_loss_terms

    lp, ent = vocab_parallel_logprobs_entropy(x @ w.t(), targets, group=group)
    mask = torch.ones(1, lp.numel(), dtype=torch.bool, device=lp.device)
    return policy_loss_terms(lp[None], ent.detach()[None], _LOSS_INPUTS["blp"][None], _LOSS_INPUTS["adv"][:1], mask,
                             _LOSS_INPUTS["cfg"]).loss_BT.sum()


# Output-layer GEMMs of forward + backward per method.
GEMMS = {"gather": 3, "unfused": 3, "fused": 4, "fused_torch": 4, "fused_loss": GEMMS_PER_PASS, "unfused_loss": 3}


def liger(x, w, targets, group, tile):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    local = (targets - dist.get_rank(group) * w.shape[0]).clamp(0, w.shape[0] - 1)
    return -LigerFusedLinearCrossEntropyLoss(reduction="none")(w, x, local), None


def cce(x, w, targets, group, tile):
    from cut_cross_entropy import linear_cross_entropy

    local = (targets - dist.get_rank(group) * w.shape[0]).clamp(0, w.shape[0] - 1)
    return -linear_cross_entropy(x, w, local, reduction="none"), None


def _entropy_unfused(x, w):
    """The entropy of this shard's softmax from its materialised logits (fp32)."""
    logits = (x @ w.t()).float()
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


def liger_ent(x, w, targets, group, tile):
    return liger(x, w, targets, group, tile)[0], _entropy_unfused(x, w)


def cce_ent(x, w, targets, group, tile):
    return cce(x, w, targets, group, tile)[0], _entropy_unfused(x, w)


METHODS = {"gather": gather_full_logits, "unfused": unfused, "fused": fused, "fused_loss": fused_loss,
           "unfused_loss": unfused_loss}
OPTIONAL = {"fused_torch": (None, fused_torch), "liger": ("liger_kernel", liger), "cce": ("cut_cross_entropy", cce),
            "liger_ent": ("liger_kernel", liger_ent), "cce_ent": ("cut_cross_entropy", cce_ent)}


def available_optional(device) -> dict:
    """(c') and fused_torch: on CUDA, where importable; else the reason they are left out."""
    found, missing = {}, {}
    for name, (module, fn) in OPTIONAL.items():
        if device.type != "cuda":
            missing[name] = "CUDA only" if module else "CUDA only (on CPU it is 'fused')"
            continue
        if module is None:
            found[name] = fn
            continue
        try:
            __import__(module)
            found[name] = fn
        except ImportError:
            missing[name] = "not installed"
    return found, missing


# ---- one measurement -----------------------------------------------------------


class Meter:
    """Peak memory increase over a call: resident set on CPU, allocator on CUDA."""

    def __init__(self, device):
        self.device = device

    def start(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        return reset_peak()

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return peak_rss()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def run_once(fn, hidden, weight, targets, g_lp, g_h, group, tile):
    x, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    out = fn(x, w, targets, group, tile)
    if isinstance(out, torch.Tensor):  # a loss method: the scalar loss itself
        loss = out
    else:
        lp, ent = out
        loss = (lp * g_lp).sum() if ent is None else (lp * g_lp + ent * g_h).sum()
    loss.backward()
    assert x.grad is not None and w.grad is not None


def _max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(rank, world, n_tokens, hidden_size, vocab, dtype_name, repeats, tile, device_name, chosen, results_path):
    device = torch.device(device_name if device_name == "cpu" else f"cuda:{rank % torch.cuda.device_count()}")
    group = dist.group.WORLD
    dtype = getattr(torch, dtype_name)
    shard = vocab // world
    gen = torch.Generator().manual_seed(1234)
    hidden = torch.randn(n_tokens, hidden_size, generator=gen).to(device, dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 2 / hidden_size**0.5)[rank * shard:(rank + 1) * shard]
    weight = weight.to(device, dtype).contiguous()
    targets = torch.randint(0, vocab, (n_tokens,), generator=gen).to(device)
    g_lp, g_h = torch.randn(n_tokens, generator=gen).to(device), torch.randn(n_tokens, generator=gen).to(device)
    grads_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    _set_loss_inputs(n_tokens, vocab, gen, device)
    optional, missing = available_optional(device)
    missing = {name: why for name, why in missing.items() if name in chosen}
    methods = {name: fn for name, fn in {**METHODS, **optional}.items() if name in chosen}
    meter = Meter(device)

    mem, times, gemm_times = {}, {name: [] for name in methods}, []
    # The reference GEMM writes into a buffer allocated once: its time is the matmul's alone,
    # not the first touch of fresh pages (on CPU every large allocation is a new mmap here).
    gemm_out = torch.mm(hidden, weight.t())
    if device.type == "cuda":
        # Untimed first calls: Triton compiles and autotunes its kernels here (the autotuner's
        # cache-flush buffer would otherwise count as the fused op's memory).
        for name, fn in methods.items():
            run_once(fn, hidden, weight, targets, g_lp, g_h, group, tile)
    for name, fn in methods.items():  # first measured round: warm-up on CPU, and memory
        gc.collect()
        dist.barrier()
        base = meter.start()
        run_once(fn, hidden, weight, targets, g_lp, g_h, group, tile)
        mem[name] = _max_over_ranks(meter.peak() - base, device)
        if rank == 0:
            print(f"  warm-up {name}: peak +{mem[name] / 2**20:.0f} MiB", flush=True)
    for _ in range(repeats):
        for name, fn in methods.items():
            gc.collect()
            dist.barrier()
            meter.sync()
            t0 = time.perf_counter()
            run_once(fn, hidden, weight, targets, g_lp, g_h, group, tile)
            meter.sync()
            times[name].append(_max_over_ranks(time.perf_counter() - t0, device))
        gc.collect()
        dist.barrier()
        meter.sync()
        t0 = time.perf_counter()
        torch.mm(hidden, weight.t(), out=gemm_out)
        meter.sync()
        gemm_times.append(_max_over_ranks(time.perf_counter() - t0, device))
        if rank == 0:
            print("  repeat: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items())
                  + f", one GEMM {gemm_times[-1]:.3f} s", flush=True)
    if rank == 0:
        with open(results_path, "a") as f:
            for name in methods:
                f.write(repr((world, name, mem[name], grads_bytes, times[name])) + "\n")
            f.write(repr((world, "gemm", None, None, gemm_times)) + "\n")
            for name, why in missing.items():
                f.write(repr((world, name, None, None, why)) + "\n")


def _set_loss_inputs(n_tokens, vocab, gen, device):
    """mu near the random model's log-probs (ENTR keeps some tokens, masks others) and advantage 1:
    the tokens are one sequence to unfused_loss and one-token rows to fused_loss, the same loss."""
    import dataclasses
    import math

    from entr_megatron.config.algorithm import AlgorithmConfig

    cfg = dataclasses.replace(AlgorithmConfig(), mask_diagnostics=False)
    _LOSS_INPUTS.update(
        blp=(-math.log(vocab) - 2.0 + torch.randn(n_tokens, generator=gen)).to(device),
        adv=torch.ones(n_tokens).to(device), cfg=cfg)


def fused_backend(device: str) -> str:
    """What 'fused' (backend "auto") runs on ``device``."""
    if device != "cuda":
        return "torch (chunked; Triton is for CUDA)"
    if not triton_available():
        return "torch (chunked; triton is not installed)"
    import triton

    return f"triton {triton.__version__}"


def print_table(rows, header):
    print()
    print(header)
    print("| TP | method | peak mem increase | mem / (b) | act (less grads) | act / (b) | time median [min, max] "
          "| time / (b) | GEMM equivalents | GEMMs run |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = {r[0]: r for r in rows if r[1] == BASELINE}
    gemm = {r[0]: statistics.median(r[4]) for r in rows if r[1] == "gemm"}
    for world, name, mem, grads, times in rows:
        if name == "gemm":
            continue
        if mem is None:
            print(f"| {world} | {name} | {times} | | | | | | | |")
            continue
        b_world, _, b_mem, b_grads, b_times = base[world]
        act, b_act = mem - grads, b_mem - b_grads
        t, bt = statistics.median(times), statistics.median(b_times)
        print(f"| {world} | {name} | {mem / 2**20:.0f} MiB | {mem / b_mem:.3f}x | {act / 2**20:.0f} MiB | "
              f"{act / b_act:.3f}x | {t:.3f} s [{min(times):.3f}, {max(times):.3f}] | {t / bt:.3f}x | "
              f"{t / gemm[world]:.2f} | {GEMMS.get(name, '')} |")
    for world, t_gemm in gemm.items():
        line = f"TP={world}: one output-layer GEMM {t_gemm * 1e3:.1f} ms (median)"
        for name in ("fused", "fused_loss"):
            found = [r for r in rows if r[0] == world and r[1] == name and r[2] is not None]
            if found:
                line += (f"; {name} GEMM efficiency ({GEMMS[name]} GEMMs' time / its time) "
                         f"{GEMMS[name] * t_gemm / statistics.median(found[0][4]):.2f}")
        print(line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[2], help="tensor-parallel sizes (one launch each)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--small", action="store_true", help="1024 tokens x h 512 x V 16384: a quick run")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-tokens", type=int, default=None, help="fused: tokens per tile (default: the op's)")
    ap.add_argument("--chunk-vocab", type=int, default=None, help="fused: columns per tile (default: the op's)")
    ap.add_argument("--methods", nargs="+", default=[*METHODS, *OPTIONAL], choices=[*METHODS, *OPTIONAL],
                    help=f"which to run ({BASELINE!r}, the baseline, always runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    args = ap.parse_args(argv)
    if args.small:
        args.tokens, args.hidden, args.vocab = 1024, 512, 16384
    bad = [tp for tp in args.tp if tp < 1 or args.vocab % tp]
    if bad:
        ap.error(f"--vocab {args.vocab} is not divisible by --tp {bad}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA device (use --device cpu)")
    chosen = sorted(set(args.methods) | {BASELINE}, key=[*METHODS, *OPTIONAL].index)
    results = f"/tmp/bench_fused_output.{os.getpid()}.txt"
    open(results, "w").close()
    header = (f"{args.tokens} tokens x h {args.hidden} x V {args.vocab}, {args.dtype} on {args.device}, "
              f"torch {torch.__version__}, {os.cpu_count()} cores, repeats {args.repeats}, "
              f"fused tile {args.chunk_tokens or 'default'} x {args.chunk_vocab or 'default'}, "
              f"fused backend {fused_backend(args.device)}")
    print(header, flush=True)
    for tp in args.tp:
        print(f"TP={tp}: {tp} gloo rank(s), {max(1, (os.cpu_count() or 1) // tp)} thread(s) each", flush=True)
        run_gloo(worker, tp, args.tokens, args.hidden, args.vocab, args.dtype, args.repeats,
                 (args.chunk_tokens, args.chunk_vocab), args.device, chosen, results, timeout_s=7200)
    with open(results) as f:
        rows = [ast.literal_eval(line) for line in f if line.strip()]
    os.unlink(results)
    print_table(rows, header)


if __name__ == "__main__":
    sys.exit(main())
