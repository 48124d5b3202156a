"""Benchmark: learner training-step throughput and where the step's time goes.

Builds a small Qwen3-style model (random weights) on spawned gloo ranks at each
requested TP size, runs ENTR training steps on synthetic rollouts and prints:

  tokens/s              tokens (prompt + response) trained per second of step time
  loss share            fraction of step time in the loss: the loss function on the
                        last stage (vocab-parallel log-prob/entropy forward, the
                        correction, the policy loss, metrics) plus the op's backward
  op / algorithm        the same split into the vocab-parallel op (fwd+bwd) and the rest

TP=1 runs one rank with all cores; TP=2 runs two ranks with a core each, so the
two rows compare the same machine, not the same per-rank resources.

`--hf-baseline` adds, in the same run, the step a single-process trainer built on HF
transformers takes (TRL's GRPOTrainer trains this way): the same model and batch, right-padded
to the longest sequence, forward, log-softmax of the response tokens, a policy-gradient
token-mean loss, backward and AdamW, with every core; the table then gives ours / HF.

    python tools/bench_learner.py                         # TP=1 and TP=2, default sizes
    python tools/bench_learner.py --tp 2 --vocab 151936 --steps 3
    python tools/bench_learner.py --tp 1 --hidden 128 --heads 4 --kv-heads 2 --vocab 58 --seqs 32 \
        --prompt-len 24 --response-len 56 --microbatch-tokens 4096 --hf-baseline   # a countdown mini-batch
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

from entr_megatron.utils.spawn import run_gloo


class _Timers:
    """Wall time accumulated inside wrapped functions of this process."""

    def __init__(self):
        self.op = 0.0
        self.loss = 0.0


def _install_timers(timers: _Timers) -> None:
    """Wrap the loss function factory and the vocab-parallel op's backward with timers."""
    from entr_megatron.learner import trainer as ts
    from entr_megatron.parallel import vocab_parallel as vp

    fn_cls = vp.VocabParallelLogProbEntropy
    fwd, bwd = fn_cls.forward, fn_cls.backward

    def timed_forward(ctx, *args):
        t0 = time.perf_counter()
        try:
            return fwd(ctx, *args)
        finally:
            timers.op += time.perf_counter() - t0

    def timed_backward(ctx, *grads):
        t0 = time.perf_counter()
        try:
            return bwd(ctx, *grads)
        finally:
            dt = time.perf_counter() - t0
            timers.op += dt
            timers.loss += dt

    fn_cls.forward, fn_cls.backward = staticmethod(timed_forward), staticmethod(timed_backward)

    make = ts.make_policy_loss_func

    def timed_make(*args, **kwargs):
        loss_func = make(*args, **kwargs)

        def timed_loss(*a, **k):
            t0 = time.perf_counter()
            try:
                return loss_func(*a, **k)
            finally:
                timers.loss += time.perf_counter() - t0

        return timed_loss

    ts.make_policy_loss_func = timed_make


def synthetic_batch(num_seqs: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    from entr_megatron.algorithm import grpo_advantages
    from entr_megatron.types import Sample, TrainBatch

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_seqs):
        r = int(torch.randint(response_len // 2, response_len + 1, (1,), generator=g))
        samples.append(Sample(
            prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
            response_ids=torch.randint(0, vocab, (r,), generator=g).tolist(),
            behaviour_logprobs=(-torch.rand(r, generator=g) * 12).tolist(),
            versions=[0] * r,
            reward=float(torch.rand(1, generator=g) > 0.5),
            group_id=i // 8,
        ))
    rewards = torch.tensor([s.reward for s in samples])
    groups = torch.tensor([s.group_id for s in samples])
    return TrainBatch.from_samples(samples, grpo_advantages(rewards, groups))


def worker(rank, world, args, results_path):
    warnings.filterwarnings("ignore")
    from entr_megatron.config.algorithm import AlgorithmConfig
    from entr_megatron.config.learner import LearnerConfig, OptimConfig
    from entr_megatron.learner.build import build_learner_model_from_hf
    from entr_megatron.learner.optimizer import build_optimizer, wrap_model_chunks
    from entr_megatron.learner.trainer import train_step
    from entr_megatron.parallel.cpu_compat import enable_cpu_compat
    from entr_megatron.parallel.groups import destroy, initialize_model_parallel

    enable_cpu_compat()
    timers = _Timers()
    _install_timers(timers)
    groups = initialize_model_parallel(tp=world)
    hf_config = {
        "model_type": "qwen3", "vocab_size": args.vocab, "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 3, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "head_dim": args.hidden // args.heads,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": False, "hidden_act": "silu",
    }
    chunks, spec = build_learner_model_from_hf(
        hf_config, groups, load_weights=False, config_overrides={"calculate_per_token_loss": True}
    )
    learner_cfg = LearnerConfig(max_tokens_per_microbatch=args.microbatch_tokens, optim=OptimConfig(lr=1e-5))
    ddp = wrap_model_chunks(chunks, groups, learner_cfg)
    optimizer, scheduler = build_optimizer(ddp, learner_cfg)
    algo_cfg = AlgorithmConfig(correction="entr")
    n_params = sum(p.numel() for c in chunks for p in c.parameters())

    rows = []
    for step in range(args.warmup + args.steps):
        batch = synthetic_batch(args.seqs, args.prompt_len, args.response_len, args.vocab, seed=step)
        timers.op = timers.loss = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        train_step(ddp, optimizer, scheduler, batch, groups, algo_cfg, learner_cfg, vocab_size=spec.vocab_size)
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            rows.append((dt, timers.loss, timers.op, int(batch.tokens_T.numel())))
    destroy()
    times = torch.tensor([[r[0], r[1], r[2]] for r in rows], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    if rank == 0:
        step_s = statistics.median(times[:, 0].tolist())
        loss_s = statistics.median(times[:, 1].tolist())
        op_s = statistics.median(times[:, 2].tolist())
        tokens = int(statistics.median(r[3] for r in rows))
        with open(results_path, "a") as f:
            f.write(repr((world, n_params * world, tokens, step_s, loss_s, op_s)) + "\n")


def hf_baseline(args) -> tuple[int, float]:
    """(tokens per step, median step seconds) of an HF transformers fwd + bwd + AdamW on the
    benchmark's batches (module docstring), in this process with torch's threads."""
    import transformers

    warnings.filterwarnings("ignore")
    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times, tokens = [], 0
    for step in range(args.warmup + args.steps):
        batch = synthetic_batch(args.seqs, args.prompt_len, args.response_len, args.vocab, seed=step)
        cu = batch.cu_seqlens.tolist()
        width = max(b - a for a, b in zip(cu[:-1], cu[1:]))
        ids = torch.zeros(len(cu) - 1, width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        weight = torch.zeros(len(cu) - 1, width)
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            ids[i, :b - a], attn[i, :b - a] = batch.tokens_T[a:b], 1
            weight[i, :b - a] = batch.loss_mask_T[a:b].float() * batch.advantages_B[i]
        t0 = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask = weight[:, 1:] != 0
        loss = -(logp * weight[:, 1:]).sum() / mask.sum().clamp(min=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            tokens = int(batch.tokens_T.numel())
    return tokens, statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8, help="attention heads (head dim: hidden / heads)")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seqs", type=int, default=16, help="sequences per step")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=192, help="responses are 1/2 to 1x this long")
    ap.add_argument("--microbatch-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--hf-baseline", action="store_true", help="also time HF transformers on the same batches")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the results (for other tools)")
    args = ap.parse_args(argv)
    results = f"/tmp/bench_learner.{os.getpid()}.txt"
    open(results, "w").close()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; qwen3-style hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}; {args.seqs} sequences/step", flush=True)
    for tp in args.tp:
        print(f"TP={tp} ...", flush=True)
        run_gloo(worker, tp, args, results, timeout_s=3600)
    with open(results) as f:
        rows = [ast.literal_eval(line) for line in f if line.strip()]
    os.unlink(results)
    print()
    print("| TP | params | tokens/step | step time | tokens/s | loss share | op (fwd+bwd) share | algorithm share |")
    print("|---|---|---|---|---|---|---|---|")
    for world, n_params, tokens, step_s, loss_s, op_s in rows:
        print(f"| {world} | {n_params / 1e6:.1f} M | {tokens} | {step_s:.3f} s | {tokens / step_s:.0f} | "
              f"{loss_s / step_s:.1%} | {op_s / step_s:.1%} | {(loss_s - op_s) / step_s:.1%} |")
    hf = None
    if args.hf_baseline:
        tokens, hf_s = hf = hf_baseline(args)
        print(f"\nHF transformers, one process, {torch.get_num_threads()} threads: {tokens} tokens in {hf_s:.3f} s "
              f"({tokens / hf_s:.0f} tokens/s); ours / HF step time: "
              + ", ".join(f"TP={world} {step_s / hf_s:.2f}x" for world, _, _, step_s, _, _ in rows))
    if args.json:
        print(json.dumps({"rows": [dict(zip(("tp", "params", "tokens", "step_s", "loss_s", "op_s"), r)) for r in rows],
                          "hf": dict(zip(("tokens", "step_s"), hf)) if hf else None}))


if __name__ == "__main__":
    sys.exit(main())
