"""A real SGLang server on CPU against the embedded engine, side by side in one run (docs/SGLANG_ON_CPU.md).

    python tools/bench_sglang_cpu.py                      # both parts, 5 repetitions, 2 threads per engine
    python tools/bench_sglang_cpu.py --part generate --threads 1 2 --reps 7
    python tools/bench_sglang_cpu.py --part push --push-layers 8

Generation: the CPU demo's and countdown's shapes (examples/cpu_demo.yaml, examples/countdown.yaml:
8 prompts x 8 samples, prompts of 10 and 15 random tokens, 8 and 64 new tokens, EOS ignored so
every sequence has its full length) on their model (Qwen3, 128 hidden, 4 layers, random weights,
nothing downloaded), by an `EmbeddedEngine` built as `train` builds it and an SGLang server
launched as `train` launches it on CPU (`server_configs`: .venv-sglang, kv_on_update keep, so
without the prefix cache), each given `--threads` OpenMP threads, the other one idle. A round
submits the 8 requests at once and waits for all 64 samples; tokens/s = generated tokens / round
time. Engines alternate round by round (load drift hits both alike); one warm-up round each is
not counted; medians and [min, max] over `--reps`.

Push: one weight version to the SGLang server as learner rank 0 pushes it, from `WeightSync.push` (the
learner's snapshot copy) until the server holds it (`SGLangEngine.update_weights`: pause,
/begin_weight_update, the buckets, /end_weight_update, continue), against a bare gloo broadcast of the
same bytes as one flat buffer from this process to a peer process (the same one-connection group as
SGLang's, then a one-integer acknowledgement, as our bucket protocol ends), push and broadcast
alternating. Two models: the demo's (3.2 MB) and a larger one (`--push-layers` layers of 1024 hidden,
float32), each a server of its own. Versions go by both paths in turn: over the gloo group
(`SGLangTransport`: each bucket packed as SGLang's flattened bucket, one /update_weights_from_distributed
while it is broadcast), and through shared memory (`SGLangTensorTransport`, `rollout.placement:
colocated`: the snapshot's buffers lie in shared memory and the server reads each bucket there, one
/update_weights_from_tensor).

Run it alone on the machine (it measures time); it prints the machine's load before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"demo": (10, 8), "countdown": (15, 64)}
"""Shape name -> (prompt tokens, new tokens); 8 prompts x 8 samples each."""
SMALL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=96)


def build_model(path: Path, **arch) -> Path:
    import transformers

    from entr_megatron.tasks import build_char_tokenizer

    tok = build_char_tokenizer()
    config = transformers.Qwen3Config(**arch, vocab_size=len(tok), tie_word_embeddings=True, rope_theta=10000.0,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


SERVER_ARGS: list[str] = []
"""--server-args: extra SGLang flags of the servers (rollout.sglang.extra_args)."""


def run_config(threads: int, *extra: str):
    from entr_megatron.config.loader import load_config

    if SERVER_ARGS:
        extra = (*extra, "rollout.sglang.extra_args=[" + ", ".join(repr(a) for a in SERVER_ARGS) + "]")
    return load_config(str(ROOT / "examples" / "cpu_demo_sglang.yaml"),
                       [f"rollout.embedded.num_threads={threads}", "model.max_seq_len=88",
                        f"rollout.sglang.python={ROOT / '.venv-sglang' / 'bin' / 'python'}", *extra])


@contextlib.contextmanager
def sglang_server(model_dir: Path, threads: int, log_dir: Path):
    from entr_megatron.controller.job.sglang_servers import server_configs
    from entr_megatron.rollout.sglang import launch_servers
    from entr_megatron.utils.spawn import free_port

    cfg = run_config(threads, f"rollout.sglang.base_port={free_port()}", "rollout.sglang.max_total_tokens=16384")
    [config] = server_configs(cfg, model_dir, routes=False, threads=threads)
    t0 = time.monotonic()
    [process] = launch_servers([config], log_dir, startup_timeout_s=900, progress=lambda line: print("  " + line))
    print(f"  SGLang server up in {time.monotonic() - t0:.0f} s")
    try:
        yield process.url
    finally:
        process.terminate()


def embedded_engine(model_dir: Path, threads: int):
    from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig

    cfg = run_config(threads, "rollout.engine=embedded")
    return EmbeddedEngine(EmbeddedEngineConfig.from_config(cfg.rollout, model_dir=str(model_dir), max_model_len=96,
                                                           seed=0, num_threads=threads, device="cpu"))


def one_round(engine, prompt_len: int, new_tokens: int, vocab: int, rng: random.Random) -> float:
    """Tokens/s of 8 prompts x 8 samples submitted at once."""
    from entr_megatron.rollout.engine import GenerateRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=8, ignore_eos=True)
    requests = [GenerateRequest([rng.randrange(3, vocab) for _ in range(prompt_len)], params) for _ in range(8)]
    t0 = time.monotonic()
    engine.submit(requests)
    got = []
    while len(got) < 64:
        got += engine.poll(timeout=1.0)
    elapsed = time.monotonic() - t0
    assert all(len(r.output_ids) == new_tokens for r in got)
    return 64 * new_tokens / elapsed


def summary(values: list[float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def bench_generate(args, work: Path) -> None:
    from entr_megatron.rollout.sglang import SGLangEngine, SGLangEngineConfig
    from entr_megatron.tasks import build_char_tokenizer

    vocab = len(build_char_tokenizer())
    model_dir = build_model(work / "small", **SMALL)
    print("\nGeneration, tokens/s, median [min, max] over", args.reps, "rounds (8 prompts x 8 samples):")
    print("| shape (prompt, new tokens) | threads | embedded engine | SGLang server | SGLang / embedded |")
    print("|---|---|---|---|---|")
    for threads in args.threads:
        embedded = embedded_engine(model_dir, threads)
        with sglang_server(model_dir, threads, work / f"logs-gen-{threads}") as url:
            sglang = SGLangEngine(SGLangEngineConfig(urls=(url,), vocab_size=vocab, generate_timeout_s=600))
            for shape, (prompt_len, new_tokens) in SHAPES.items():
                rng = random.Random(0)
                rates = {"embedded": [], "sglang": []}
                for rep in range(args.reps + 1):
                    for name, engine in (("embedded", embedded), ("sglang", sglang)):
                        rate = one_round(engine, prompt_len, new_tokens, vocab, rng)
                        if rep:
                            rates[name].append(rate)
                ratio = [s / e for s, e in zip(rates["sglang"], rates["embedded"])]
                print(f"| {shape} ({prompt_len}, {new_tokens}) | {threads} | {summary(rates['embedded'])} | "
                      f"{summary(rates['sglang'])} | {summary(ratio, '{:.2f}')}x |", flush=True)
            sglang.shutdown()
        embedded.shutdown()


def _bare_peer(spec, nbytes: int, reps: int) -> None:
    from entr_megatron.weight_sync.group import BroadcastGroup

    group = BroadcastGroup.join(spec, 1, timeout_s=300)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(reps):
        group.broadcast(flat)
        group.all_reduce_sum(0)
    group.close()


class BareBroadcast:
    """A peer process in a one-connection gloo group (as SGLang's); `once()` times one broadcast of
    `nbytes` as one flat buffer to it, then its acknowledgement. `count` broadcasts in all."""

    def __init__(self, nbytes: int, count: int):
        from entr_megatron.utils.spawn import free_port
        from entr_megatron.weight_sync.group import BroadcastGroup, WeightGroup

        spec = WeightGroup("127.0.0.1", free_port(), 2, "bare", "gloo", (1,))
        self.peer = mp.get_context("spawn").Process(target=_bare_peer, args=(spec, nbytes, count))
        self.peer.start()
        self.group = BroadcastGroup.join(spec, 0, timeout_s=300)
        self.flat = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)

    def once(self) -> float:
        t0 = time.perf_counter()
        self.group.broadcast(self.flat)
        self.group.all_reduce_sum(0)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.group.close()
        self.peer.join(60)


@contextlib.contextmanager
def timed_calls():
    """Seconds spent in each SGLangClient call of the push (the server's side, as the client sees it),
    and in packing each version's buckets (`pack (ours)`, a version's total)."""
    from entr_megatron.rollout.sglang import SGLangClient

    names = ("pause_generation", "begin_weight_update", "update_weights_from_distributed", "update_weights_from_tensor",
             "end_weight_update", "continue_generation")
    spent: dict[str, list[float]] = {n: [] for n in names}
    originals = {n: getattr(SGLangClient, n) for n in names}

    def timed(name):
        def call(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return originals[name](self, *a, **kw)
            finally:
                spent[name].append(time.perf_counter() - t0)
        return call

    import entr_megatron.weight_sync.sglang_transports as transports

    packing = transports.iter_flattened_buckets

    def timed_packing(*args, **kwargs):  # the copy of each bucket into the pack buffer (our side)
        buckets, total = packing(*args, **kwargs), 0.0
        while True:
            t0 = time.perf_counter()
            bucket = next(buckets, None)
            total += time.perf_counter() - t0
            if bucket is None:
                spent["pack (ours)"].append(total)
                return
            yield bucket

    spent["pack (ours)"] = []
    for n in names:
        setattr(SGLangClient, n, timed(n))
    transports.iter_flattened_buckets = timed_packing
    try:
        yield spent
    finally:
        for n, f in originals.items():
            setattr(SGLangClient, n, f)
        transports.iter_flattened_buckets = packing


def bench_push(args, work: Path) -> None:
    from entr_megatron.rollout.sglang import SGLangEngine, SGLangEngineConfig
    from entr_megatron.utils.spawn import free_port
    from entr_megatron.weight_sync import WeightSync, WeightSyncConfig
    from entr_megatron.weight_sync.sglang_transports import SGLangTensorTransport, SGLangTransport

    models = {"demo (4 x 128)": SMALL,
              f"larger ({args.push_layers} x 1024)": dict(hidden_size=1024, intermediate_size=2816,
                                                         num_hidden_layers=args.push_layers, num_attention_heads=8,
                                                         num_key_value_heads=4, head_dim=128, max_position_embeddings=96)}
    print("\nWeight push, seconds per version, median [min, max] over", args.reps, "versions each way:")
    calls = []
    print("| model | MB | path | push (push() to every server holding it) | of which the learner's snapshot copy | "
          "SGLang's part (pause to continue) | bare gloo broadcast | push / bare |")
    print("|---|---|---|---|---|---|---|---|")
    for label, arch in models.items():
        import transformers

        model_dir = build_model(work / label.split()[0], **arch)
        weights = {k: v for k, v in transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()
                   if k != "lm_head.weight"}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        paths = ("gloo group", "shared memory")
        totals, copies, sglang_part, bare = ({p: [] for p in paths} for _ in range(4))
        with sglang_server(model_dir, max(args.threads), work / f"logs-push-{label.split()[0]}") as url:
            engine = SGLangEngine(SGLangEngineConfig(urls=(url,), weight_update_timeout_s=600, kv_on_update="keep"))
            # as learner rank 0 pushes: the snapshot (WeightSync), then the transport of each placement
            config = WeightSyncConfig(bucket_bytes=engine.config.weight_bucket_bytes, dtype=engine.config.weight_dtype)
            current = {}
            transports = {"gloo group": SGLangTransport(engine, "127.0.0.1", free_port(), backend="gloo"),
                          "shared memory": SGLangTensorTransport(engine)}
            syncs = {p: WeightSync(lambda: current.items(), t, config) for p, t in transports.items()}
            for t in transports.values():
                t.connect()
            baseline = BareBroadcast(nbytes, 2 * (args.reps + 1))  # alternating with the pushes: load drift hits all
            version = 0
            with timed_calls() as spent:
                for rep in range(args.reps + 1):
                    for path in paths:
                        engine.set_weight_transfer(transports[path].updates)
                        current.clear()
                        current.update({k: v + 0.01 * (rep + 1) for k, v in weights.items()})
                        version += 1
                        report = syncs[path].push(version).wait(timeout=600)
                        bare_s = baseline.once()
                        if rep:
                            totals[path].append(report.transfer_s)  # from push() until the server held it
                            copies[path].append(report.blocked_s)
                            sglang_part[path].append(report.engines[0].total_s)
                            bare[path].append(bare_s)
                    if not rep:
                        for v in spent.values():
                            v.clear()
            baseline.close()
            for sync in syncs.values():
                sync.close()
            engine.shutdown()
        for path in paths:
            ratio = [t / b for t, b in zip(totals[path], bare[path])]
            print(f"| {label} | {nbytes / 1e6:.1f} | {path} | {summary(totals[path], '{:.3f}')} | "
                  f"{summary(copies[path], '{:.3f}')} | {summary(sglang_part[path], '{:.3f}')} | "
                  f"{summary(bare[path], '{:.3f}')} | {summary(ratio, '{:.2f}')}x |", flush=True)
        calls.append((label, {n: statistics.median(v) for n, v in spent.items() if v},
                      {n: len(v) / args.reps for n, v in spent.items() if v}))
    print("\nWhere a push's time goes: median seconds of each call as the client waits for it (calls per version "
          "pair, one push each way):")
    for label, medians, counts in calls:
        print(f"  {label}: " + ", ".join(f"{n} {t:.3f} (x{counts[n]:g})" for n, t in medians.items()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["generate", "push", "both"], default="both")
    parser.add_argument("--threads", type=int, nargs="+", default=[2], help="OpenMP threads per engine")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--push-layers", type=int, default=8, help="layers of the larger push model (1024 hidden)")
    parser.add_argument("--server-args", nargs="*", default=[], help="extra SGLang server flags, e.g. --server-args=--x")
    args = parser.parse_args(argv)
    SERVER_ARGS[:] = args.server_args
    if not (ROOT / ".venv-sglang" / "bin" / "python").exists():
        sys.exit("no .venv-sglang: run bash scripts/setup_sglang_cpu.sh first")
    print(f"load average before: {os.getloadavg()}; cores: {os.cpu_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("generate", "both"):
            bench_generate(args, Path(tmp))
        if args.part in ("push", "both"):
            bench_push(args, Path(tmp))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
