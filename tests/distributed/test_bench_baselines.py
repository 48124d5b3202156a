"""The GPU benchmark's baselines as tools/bench_fused_output.py calls them (Liger's fused linear
cross-entropy, Cut Cross-Entropy, and the entropy it adds to each unfused), on 2 gloo ranks
against float64: each rank's log-probs over its own vocabulary shard (targets outside it clamped
into it, as the benchmark does), entropies and both gradients under per-token upstream
gradients. Liger runs its Triton kernels in Triton's CPU interpreter; CCE's Triton kernels do
not run there, so its `torch_compile` implementation stands in (the same function, the same
arguments otherwise)."""

import functools
import shutil
import sys
from pathlib import Path

import pytest
import torch
from common import INTERPRETER, close

from entr_megatron.utils.spawn import run_gloo

TOOLS = str(Path(__file__).resolve().parents[2] / "tools")
VOCAB, HIDDEN, TOKENS = 96, 24, 21


def _case():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 4 / HIDDEN**0.5
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    return hidden, weight, targets, torch.randn(TOKENS, generator=g), torch.randn(TOKENS, generator=g)


def _local_reference(hidden, shard, local_targets, g_lp, g_h):
    """float64: this shard's softmax; (lp, H, d loss/d hidden, d loss/d shard)."""
    x, w = hidden.double().requires_grad_(), shard.double().requires_grad_()
    logp = torch.log_softmax(x @ w.t(), -1)
    lp = logp.gather(-1, local_targets[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    (lp * g_lp.double() + ent * g_h.double()).sum().backward()
    return lp.detach(), ent.detach(), x.grad, w.grad


def _check_baselines(rank, world, methods):
    sys.path.insert(0, TOOLS)
    import bench_fused_output as bench

    if any(m.startswith("cce") for m in methods):
        import cut_cross_entropy  # the benchmark imports linear_cross_entropy from it at each call

        cut_cross_entropy.linear_cross_entropy = functools.partial(cut_cross_entropy.linear_cross_entropy,
                                                                   impl="torch_compile")
    hidden, weight, targets, g_lp, g_h = _case()
    n = VOCAB // world
    shard = weight[rank * n:(rank + 1) * n].contiguous()
    local = (targets - rank * n).clamp(0, n - 1)
    assert (local != targets - rank * n).any()  # some targets lie on the other rank
    for name in methods:
        x, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
        lp, ent = getattr(bench, name)(x, w, targets, torch.distributed.group.WORLD, (None, None))
        with_entropy = name.endswith("_ent")
        assert (ent is not None) == with_entropy, name
        # log-prob only: the upstream gradient reaches the log-probs alone
        g = g_h if with_entropy else torch.zeros_like(g_h)
        want_lp, want_h, want_gx, want_gw = _local_reference(hidden, shard, local, g_lp, g)
        (lp * g_lp + (ent * g_h if with_entropy else 0)).sum().backward()
        close(lp, want_lp, f"{name} log-probs", tol=0, atol=1e-5)
        if with_entropy:
            close(ent, want_h, f"{name} entropy", tol=0, atol=1e-5)
        close(x.grad, want_gx, f"{name} d hidden")
        close(w.grad, want_gw, f"{name} d weight")


@pytest.mark.skipif(not INTERPRETER, reason="needs Triton's CPU interpreter (triton >= 3.9, TRITON_INTERPRET=1)")
def test_liger_as_benchmarked_matches_float64_with_per_token_gradients():
    pytest.importorskip("liger_kernel")
    run_gloo(_check_baselines, 2, ["liger", "liger_ent"], threads=1)


def test_cce_as_benchmarked_matches_float64_with_per_token_gradients():
    pytest.importorskip("cut_cross_entropy")
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("CCE's torch_compile path compiles C++ on CPU: no compiler here")
    run_gloo(_check_baselines, 2, ["cce", "cce_ent"], threads=1)


def test_bench_learner_times_ours_and_hf_on_the_same_tokens():
    """tools/bench_learner.py runs end to end (it had rotted once, unnoticed) and its HF baseline
    trains on exactly the tokens our learner trained on."""
    import re
    import subprocess

    out = subprocess.run(
        [sys.executable, f"{TOOLS}/bench_learner.py", "--tp", "1", "--hidden", "32", "--layers", "1", "--vocab", "64",
         "--seqs", "4", "--prompt-len", "4", "--response-len", "8", "--microbatch-tokens", "64", "--steps", "1",
         "--warmup", "0", "--hf-baseline"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    ours = re.search(r"^\| 1 \| [0-9.]+ M \| (\d+) \| ([0-9.]+) s \|", out, re.M)
    hf = re.search(r"HF transformers, one process, \d+ threads: (\d+) tokens in ([0-9.]+) s .*TP=1 ([0-9.]+)x", out)
    assert ours and hf, out
    assert ours.group(1) == hf.group(1)
    assert float(hf.group(2)) > 0 and float(hf.group(3)) > 0
