"""What the real-server tests share (named apart from tests/helpers.py, which tests import as
`helpers`): the HF reference (the same weights in transformers, our venv), a link to a server
(an SGLangEngine with SGLang's weight handshake over a gloo group whose rank 0 is this process,
as learner rank 0's), and small waits."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from entr_megatron.rollout.engine import GenerateRequest, GenerateResult, SamplingParams
from entr_megatron.rollout.sglang import SGLangEngine, SGLangEngineConfig
from entr_megatron.utils.spawn import free_port
from entr_megatron.weight_sync.group import BroadcastGroup
from entr_megatron.weight_sync.sglang_transports import SGLangTensorUpdate, SGLangWeightUpdate

FLOAT32_ATOL = 1e-4
"""|server log-prob - HF log-prob| allowed, both float32 on CPU: SGLang's torch_native attention
and fused QKV / gate-up projections sum in another order than transformers' eager layers (measured
up to a few 1e-6; 1e-4 is a bound float32 rounding over 4 layers cannot reach, a wrong weight
or position far exceeds)."""
PROMPT = [5, 17, 9, 12, 30, 3]
ARCH = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64,
        "rope_theta": 10000.0, "tie_word_embeddings": True}
"""The CPU demo's model (examples/cpu_demo.yaml), 0.8 M parameters with the character tokenizer."""


class Reference:
    """The model in transformers (float32), loaded with any version's weights."""

    def __init__(self, model_dir: Path):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.base = {k: v.clone() for k, v in self.model.state_dict().items() if k != "lm_head.weight"}

    def weights(self, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
        """A version: every tensor moved by scale * N(0, 1) noise (seeded), in HF names (tied head left out)."""
        g = torch.Generator().manual_seed(seed)
        return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in self.base.items()}

    def logits(self, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
        self.model.load_state_dict(weights, strict=False)
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0].double()

    def logprobs(self, weights, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
        """log_softmax(logits / T) of each output token given everything before it."""
        lp = torch.log_softmax(self.logits(weights, prompt + output) / temperature, -1)
        return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]

    def greedy(self, weights, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits(weights, ids)[-1].argmax()))
        return ids[len(prompt):]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


@contextlib.contextmanager
def link(url: str, vocab_size: int, **config):
    """An SGLangEngine over the server with a weight group joined (this process is rank 0), left on exit."""
    engine = SGLangEngine(SGLangEngineConfig(urls=(url,), vocab_size=vocab_size, request_timeout_s=60,
                                             generate_timeout_s=300, weight_update_timeout_s=120,
                                             retry_backoff_s=0.1, **config))
    update, held = SGLangWeightUpdate(engine), {}
    update.init_weights_update_group("127.0.0.1", free_port(), backend="gloo",
                                     join=lambda spec: held.setdefault("group", BroadcastGroup.join(spec, 0, timeout_s=120)))
    update.set_weight_sender(held["group"])
    try:
        yield engine
    finally:
        update.destroy_weights_update_group()
        held["group"].close()
        engine.shutdown()


@contextlib.contextmanager
def link_shared(url: str, vocab_size: int, **config):
    """An SGLangEngine over the server taking weights through shared memory (/update_weights_from_tensor:
    rollout.placement colocated), no group."""
    engine = SGLangEngine(SGLangEngineConfig(urls=(url,), vocab_size=vocab_size, request_timeout_s=60,
                                             generate_timeout_s=300, weight_update_timeout_s=120,
                                             retry_backoff_s=0.1, **config))
    SGLangTensorUpdate(engine).attach()
    try:
        yield engine
    finally:
        engine.shutdown()


def request(n_tokens: int, temperature: float = 1.0, n: int = 1, rid: str | None = None, **kw) -> GenerateRequest:
    return GenerateRequest(list(PROMPT), SamplingParams(max_new_tokens=n_tokens, temperature=temperature, n=n,
                                                        ignore_eos=True, **kw), request_id=rid)


def results(engine: SGLangEngine, count: int, timeout_s: float = 120.0) -> list[GenerateResult]:
    """`count` samples from engine.poll, in sample order."""
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < count:
        assert time.monotonic() < deadline, f"{len(out)} of {count} samples after {timeout_s} s"
        out += engine.poll(timeout=0.5)
    return sorted(out, key=lambda r: (r.request_id, r.sample_index))


def nothing_for(engine: SGLangEngine, seconds: float) -> bool:
    """No sample arrives for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if engine.poll(timeout=0.2):
            return False
    return True


def full_time(engine: SGLangEngine, make) -> float:
    """Seconds the request `make()` takes from submit to its samples."""
    r = make()
    t0 = time.monotonic()
    engine.submit([r])
    results(engine, r.params.n)
    return time.monotonic() - t0


def submit_and_pause_midway(engine: SGLangEngine, make, t_full: float) -> str:
    """Submit `make()` and pause the servers once part of its response is generated (not all of it:
    nothing has come back, so the request is still on the server); returns its id. The response is
    not streamed, so the moment is a fraction of `t_full` (full_time), shorter after each miss."""
    for fraction in (0.4, 0.25, 0.15, 0.08, 0.04):
        r = make()
        (rid,) = engine.submit([r])
        time.sleep(fraction * t_full)
        engine.pause()
        done = engine.poll(timeout=0.5)
        if not done:
            return rid
        engine.resume()  # it finished before the pause: drain it and try sooner
        if len(done) < r.params.n:
            results(engine, r.params.n - len(done))
    raise AssertionError(f"every request finished within a fraction of {t_full:.2f} s; none was paused midway")
