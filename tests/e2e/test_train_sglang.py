"""`entr-megatron train` with `rollout.engine: sglang`, end to end on CPU against mock SGLang servers.

The servers are `sglang_mock.MockSGLangServer`s (SGLang 0.5.23's HTTP protocol) run by
this test and given to the run in `rollout.sglang.urls`; each joins the gloo weight-update
group with its tp_size ranks and receives every flattened bucket as SGLang does. The run
itself is the real CLI: learner ranks in processes, the controller generating through
`SGLangEngine`, learner rank 0 updating the servers through `SGLangTransport`.

The mock generates fake tokens (a function of the prompt and the seed), so rewards are
mostly constant and nothing is learned: this checks the wiring, not learning. Checked
against what the run leaves on disk (metrics.jsonl, the final HF export) and what the
servers received (one version per step, the model's tensors in buckets of the configured
size, the learner's final weights held at the end).

A last test launches servers the way `train` does (`make_engines`, `python -m
sglang.launch_server`) with a stand-in `sglang` package that runs the mock as a script.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
import yaml

from entr_megatron.utils.run_log import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from sglang_mock import MockSGLangServer  # noqa: E402

# Two decoder layers of ~1 MB each in float32: with 1 MiB buckets a version takes several buckets.
ARCH = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64,
        "tie_word_embeddings": True}
MIB = 1 << 20


class GlooServer:
    """A MockSGLangServer whose tp_size ranks join the weight group and receive each bucket (one
    flat uint8 broadcast, unpacked by names / dtypes / shapes, as SGLang's flattened_bucket)."""

    def __init__(self, server: MockSGLangServer):
        self.server, self.ranks = server, []
        self.updates: list[dict] = []  # per /update_weights_from_distributed: version, names, bytes
        self.held: dict[str, torch.Tensor] = {}  # what rank 0 holds now
        self.rank_bytes: list[int] = []
        server.on_init_group, server.on_update_weights, server.on_destroy_group = self.init, self.update, self.destroy

    def _each_rank(self, fn, n):
        out, errors = [None] * n, []

        def run(i):
            try:
                out[i] = fn(i)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        if errors:
            raise errors[0]
        return out

    def init(self, p):
        from entr_megatron.weight_sync import BroadcastGroup
        from entr_megatron.weight_sync.group import WeightGroup

        spec = WeightGroup(p["master_address"], p["master_port"], p["world_size"], p["group_name"], p["backend"], ())
        self.ranks = self._each_rank(lambda i: BroadcastGroup.join(spec, p["rank_offset"] + i, timeout_s=120),
                                     self.server.tp_size)
        self.rank_bytes = [0] * len(self.ranks)

    def update(self, p):
        from entr_megatron.rollout.sglang import FlatBucket, unpack_flattened_bucket

        assert p["load_format"] == "flattened_bucket"
        dtypes = [getattr(torch, d) for d in p["dtypes"]]
        nbytes = sum(math.prod(s) * d.itemsize for s, d in zip(p["shapes"], dtypes))

        def recv(i):
            flat = torch.empty(nbytes, dtype=torch.uint8)
            self.ranks[i].broadcast(flat)
            self.rank_bytes[i] += nbytes
            return flat

        flats = self._each_rank(recv, len(self.ranks))
        assert all(torch.equal(flats[0], f) for f in flats[1:]), "the tp ranks received different bytes"
        tensors = unpack_flattened_bucket(FlatBucket(p["names"], p["dtypes"], p["shapes"], flats[0]))
        self.held.update((name, t.clone()) for name, t in tensors)
        self.updates.append({"version": p["weight_version"], "names": list(p["names"]), "bytes": nbytes})

    def destroy(self, p):
        for g in self.ranks:
            g.close()

    def versions(self) -> list[list[dict]]:
        """The updates grouped by version (SGLang sets the version with the last bucket)."""
        out, current = [], []
        for u in self.updates:
            current.append(u)
            if u["version"] is not None:
                out.append(current)
                current = []
        assert not current, f"an update without its version-setting last bucket: {current}"
        return out


def write_run(tmp: Path, name: str, urls: list[str], mode: str, **rollout) -> tuple[Path, Path]:
    run_dir = tmp / name
    cfg = {
        "model": {"architecture": ARCH, "max_prompt_len": 16, "max_seq_len": 32},
        "algorithm": {"correction": "entr", "tau": 0.5},
        "learner": {"optim": {"lr": 1.0e-3}},
        "rollout": {"engine": "sglang", "num_engines": len(urls), "dtype": "float32", "prompts_per_step": 4,
                    "weight_bucket_mib": 1, "sampling": {"max_new_tokens": 6, "n": 4},
                    "sglang": {"urls": urls}, **rollout},
        "controller": {"mode": mode, "train_steps": 3, "max_policy_lag": 2, "checkpoint_interval": 0},
        "task": {"name": "arithmetic", "eval_size": 8, "arithmetic": {"digits": 1, "operations": ["+"],
                                                                      "format_reward": 0.2}},
        "launcher": {"device": "cpu", "cpu_threads_per_rank": 1},
        "logging": {"run_dir": str(run_dir), "progress_bar": False, "log_interval": 1, "tensorboard": False},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir


def train(config: Path, timeout: float = 900) -> None:
    proc = subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", str(config)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stderr (tail) ---\n{proc.stderr[-6000:]}"


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The learner's final weights as its HF export wrote them, less the tied output layer
    (engines tie it to the input embedding, so it is not sent)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted((run_dir / "final_model").glob("*.safetensors")):
        out.update(load_file(str(f)))
    out.pop("lm_head.weight", None)
    return out


def vocab_size() -> int:
    from entr_megatron.tasks import build_char_tokenizer

    return len(build_char_tokenizer())


@pytest.mark.parametrize("mode, bound, tp_sizes, kv", [("sync", 0, (1,), "recompute"),
                                                        ("fully_async", 2, (1, 2), "keep")])
def test_train_drives_sglang_servers(tmp_path, mode, bound, tp_sizes, kv):
    v = vocab_size()
    servers = [MockSGLangServer(vocab_size=v, tp_size=tp, token_delay_s=0.002, weight_version="0",
                                prefix_cache=kv != "keep").start()  # keep: started with --disable-radix-cache
               for tp in tp_sizes]
    gloo = [GlooServer(s) for s in servers]
    servers[0].fail_next["/generate"] = (500, {"error": {"message": "internal error (mock)"}})  # sent again: nothing lost
    try:
        config, run_dir = write_run(tmp_path, mode, [s.url for s in servers], mode, kv_on_update=kv)
        train(config)
    finally:
        for s in servers:
            s.stop()

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["policy_version"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert 0 <= row["policy_lag/max"] <= bound, row
    # the last push waited for by the end of step k: sync waits for k + 1 (trained in the step);
    # fully_async has k + 1 in flight and waited for k (step 0: the initial push of version 0)
    pushed = [r["weight_sync/version"] for r in rows]
    assert pushed == ([1, 2, 3] if mode == "sync" else [0, 1, 2])
    if mode == "sync":
        assert all(r["policy_lag/max"] == 0 for r in rows)

    expected = final_weights(run_dir)
    total = sum(t.numel() * t.element_size() for t in expected.values())
    assert total > MIB, "the model must span several buckets for this test to mean anything"
    for g, s in zip(gloo, servers):
        # the servers' weights are unknown at start (given by URL): version 0 is pushed, then one per step
        by_version = g.versions()
        assert [u[-1]["version"] for u in by_version] == ["0", "1", "2", "3"]
        for updates in by_version:
            sizes = [u["bytes"] for u in updates]
            assert sum(sizes) == total  # float32 on the wire: the learner's dtype, as the engine's
            assert len(updates) >= math.ceil(total / MIB) and all(b <= MIB for b in sizes), sizes
            names = [n for u in updates for n in u["names"]]
            assert sorted(names) == sorted(expected), "every tensor once per version"
        assert g.rank_bytes == [4 * total] * s.tp_size  # each tp rank received every version
        # after training the server holds the learner's final version and weights
        assert s.weight_version == "3"
        for name, t in expected.items():
            torch.testing.assert_close(g.held[name], t.float(), rtol=0, atol=0, msg=name)
        assert len(s.calls_to("/init_weights_update_group")) == 1
        assert len(s.calls_to("/destroy_weights_update_group")) == 1  # the learner left the group on exit
        assert s.calls_to("/generate"), "the controller generated through the server"
    assert any(".r1" in str(c["rid"]) for c in servers[0].calls_to("/generate")), "the failed request was sent again"
    if len(servers) > 1:  # both servers served rollouts
        assert all(len(s.calls_to("/generate")) > 3 for s in servers)


def test_launched_servers_are_configured_and_stopped(tmp_path, monkeypatch):
    """`train`'s launch path: `python -m sglang.launch_server` with the run's settings, one server
    per engine on the GPUs after the learner's, driven by one SGLangEngine, stopped by the ExitStack."""
    from entr_megatron.config.loader import load_config
    from entr_megatron.controller.job.run import check_launch, make_engines
    from entr_megatron.rollout.engine import GenerateRequest, SamplingParams, generate
    from entr_megatron.utils.spawn import free_port

    fake = tmp_path / "fake_site" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    unit = Path(__file__).resolve().parents[1] / "unit"
    (fake / "launch_server.py").write_text(f"import sys\nsys.path.insert(0, {str(unit)!r})\n"
                                           "from sglang_mock import main\nmain()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")]))
    port = free_port()
    (tmp_path / "model").mkdir()  # the launcher checks the model directory before it starts anything
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen3"}')
    cfg = load_config(None, [
        "rollout.engine=sglang", "rollout.num_engines=2", "rollout.dtype=bfloat16", "model.dtype=bfloat16",
        f"rollout.sglang.base_port={port}", "rollout.sglang.mem_fraction_static=0.7",
        "rollout.sglang.extra_args=['--disable-radix-cache']", "rollout.sglang.startup_timeout_s=120",
        "launcher.device=cuda", "launcher.gpus_per_node=4", "launcher.nproc_per_node=2", "parallel.tp=2",
    ])
    with ExitStack() as stack:
        [engine] = make_engines(cfg, tmp_path / "model", stack, tmp_path / "logs")
        assert engine.config.urls == (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}")
        assert engine.config.weight_bucket_bytes == 512 * MIB and engine.config.weight_dtype is None
        assert engine.weight_version == 0
        [result] = generate(engine, [GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=4))], timeout_s=60)
        assert len(result.output_ids) == 4 and result.versions == [0] * 4
        logs = {i: (tmp_path / "logs" / f"sglang-{port + i}.log").read_text().splitlines()[0] for i in (0, 1)}
    for i, line in logs.items():
        argv = line.removeprefix("$ ").split()
        flags = dict(zip(argv[3::2], argv[4::2]))
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        assert flags["--model-path"] == str(tmp_path / "model") and flags["--tp-size"] == "1"
        assert flags["--port"] == str(port + i) and flags["--dtype"] == "bfloat16"
        assert flags["--base-gpu-id"] == str(2 + i)  # the learner's 2 ranks hold GPUs 0 and 1
        assert flags["--mem-fraction-static"] == "0.7" and flags["--weight-version"] == "0"
        assert argv[-1] == "--disable-radix-cache"
    for i in (0, 1):  # the servers were stopped with the stack
        from entr_megatron.rollout.sglang import SGLangClient

        assert not SGLangClient(f"http://127.0.0.1:{port + i}").is_healthy(timeout=2)

    ray = load_config(None, ["rollout.engine=sglang", "launcher.device=cuda", "launcher.gpus_per_node=2",
                             "launcher.kind=ray"])
    with pytest.raises(ValueError, match=r"rollout\.sglang\.urls"):
        check_launch(ray)
