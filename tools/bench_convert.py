"""Benchmark `entr-megatron convert` both ways on a random Llama of at least 2 GB (fp32).

    python tools/bench_convert.py [--gb 2.0] [--dir /tmp/bench] [--verify] [--max-shard-size 500MB] [--repeat 3]

Writes the random model straight into safetensors shards (no transformers model in memory),
then runs hf-to-megatron and megatron-to-hf as subprocesses, sampling the memory of the whole
process tree (the command and anything it starts: the sum of their PSS) with psutil. The same two
commands on a tiny model, run just before, give the baseline (interpreter, torch, megatron), so
"peak increase" is what the model's size adds. Prints wall time, GB/s and the increase as a
multiple of the model size for each repetition, then the median and range of each. Without
--verify (the default) the commands run with --no-verify: the verification builds the model
and loads it in transformers, which the conversion itself never does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from entr_megatron.checkpoint.hf_files import ShardWriter, merge_shards, parse_size

VOCAB, HIDDEN, FFN, HEADS = 32000, 2048, 5632, 16


def llama_config(layers: int, hidden: int = HIDDEN, ffn: int = FFN, vocab: int = VOCAB, heads: int = HEADS) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": heads, "vocab_size": vocab, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
            "torch_dtype": "float32"}


def write_random_llama(out: Path, config: dict, max_shard_bytes: int) -> int:
    """A random HF Llama directory, one tensor at a time; returns its bytes."""
    out.mkdir(parents=True)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes.update({p + f"self_attn.{name}.weight": (h, h) for name in ("q_proj", "k_proj", "v_proj", "o_proj")})
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    g = torch.Generator().manual_seed(0)
    writer = ShardWriter(out, max_shard_bytes, expected=[(n, torch.float32, s) for n, s in shapes.items()])
    for name, shape in shapes.items():
        writer.add(name, torch.ones(shape) if len(shape) == 1 else torch.randn(*shape, generator=g) * 0.02)
    writer.finish()
    merge_shards(out, ["shard"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return writer.written_bytes


def run_measured(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak memory of the process tree) of a command; raises when it fails.

    Memory is the sum of the processes' PSS (proportional set size): processes that share pages
    (forked ones) are not counted twice, as a sum of RSS would."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root, peak, done = psutil.Process(proc.pid), [0], threading.Event()

    def sample():
        while not done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_full_info().pss
                    except psutil.Error:
                        pass
                peak[0] = max(peak[0], total)
            except psutil.Error:
                pass
            time.sleep(0.1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    output = proc.communicate()[0]
    done.set()
    thread.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-4000:]}")
    return time.monotonic() - started, peak[0]


def convert_both_ways(base: Path, hf: Path, extra: list[str], shard: str) -> dict:
    exe = [sys.executable, "-m", "entr_megatron.cli.main", "convert"]
    ckpt, back = base / (hf.name + "_ckpt"), base / (hf.name + "_back")
    to_m = run_measured([*exe, "hf-to-megatron", "--hf", str(hf), "--out", str(ckpt), *extra])
    to_hf = run_measured([*exe, "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(back),
                          "--max-shard-size", shard, *extra])
    return {"hf-to-megatron": to_m, "megatron-to-hf": to_hf}


def _summary(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}, {format(max(values), fmt)}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0, help="smallest model size in GB (default 2)")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    parser.add_argument("--verify", action="store_true", help="also verify (loads the model in transformers)")
    parser.add_argument("--max-shard-size", default="500MB", help="shards of the source and of the output")
    parser.add_argument("--repeat", type=int, default=1, help="measure this many times (tiny, then big, each)")
    args = parser.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-convert-"))
    shard = args.max_shard_size
    per_layer = 4 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN)
    fixed = 4 * (2 * VOCAB * HIDDEN + HIDDEN)
    layers = max(1, -(-int(args.gb * 1e9 - fixed) // per_layer))
    extra = [] if args.verify else ["--no-verify"]
    try:
        t0 = time.monotonic()
        size = write_random_llama(base / "big", llama_config(layers), parse_size(shard))
        print(f"random llama: {layers} layers, hidden {HIDDEN}, vocab {VOCAB}: {size / 1e9:.3f} GB fp32 "
              f"written in {time.monotonic() - t0:.1f} s", flush=True)
        write_random_llama(base / "tiny", llama_config(2, hidden=64, ffn=96, vocab=128, heads=4), parse_size(shard))
        rows: dict[str, list[tuple[float, float, float, float]]] = {}
        print(f"{'run':<4} {'direction':<16} {'wall s':>8} {'GB/s':>6} {'peak PSS GB':>11} {'baseline GB':>11} "
              f"{'increase GB':>11} {'x model':>7}", flush=True)
        for rep in range(args.repeat):
            tiny = convert_both_ways(base, base / "tiny", extra, shard)
            big = convert_both_ways(base, base / "big", extra, shard)
            for direction in big:
                (wall, peak), (_, base_peak) = big[direction], tiny[direction]
                increase = peak - base_peak
                rows.setdefault(direction, []).append((wall, size / 1e9 / wall, increase / 1e9, increase / size,
                                                       tiny[direction][0]))
                print(f"{rep:<4} {direction:<16} {wall:>8.1f} {size / 1e9 / wall:>6.3f} {peak / 1e9:>11.2f} "
                      f"{base_peak / 1e9:>11.2f} {increase / 1e9:>11.2f} {increase / size:>7.2f}", flush=True)
            for d in (base / "big_ckpt", base / "big_back", base / "tiny_ckpt", base / "tiny_back"):
                shutil.rmtree(d, ignore_errors=True)
        print(f"\nmedian [min, max] of {args.repeat} run(s), model {size / 1e9:.3f} GB:")
        for direction, values in rows.items():
            wall, rate, inc, ratio, tiny_wall = zip(*values)
            print(f"  {direction:<16} wall {_summary(wall, '.1f')} s, {_summary(rate, '.3f')} GB/s, peak increase "
                  f"{_summary(inc, '.2f')} GB = {_summary(ratio, '.2f')} x model; the tiny model's wall "
                  f"{_summary(tiny_wall, '.1f')} s")
        print(f"(wall time includes process start-up, about the tiny model's; {'with' if args.verify else 'without'} "
              f"--verify; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f})")
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
