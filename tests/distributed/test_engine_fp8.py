"""An FP8 embedded engine (`rollout.quantize: fp8`) samples from rounded weights at load and after
every weight update it receives, two of them back to back included (its own process, queue transport).

The rounding itself is checked against a float64 e4m3 reference in tests/unit/test_rollout_quantize.py;
here the engine's log-probs must equal those of an in-process model rounded the same way, and differ
from the unrounded model's.
"""

import pytest
import torch

from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig
from entr_megatron.rollout.engine import GenerateRequest, SamplingParams, generate
from entr_megatron.rollout.quantize import install_rounding

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1,
            tie_word_embeddings=True)
PROMPT = [5, 17, 3, 40, 22]
ATOL = 1e-5  # fp32 noise between the engine's cached decode and a full forward


def qwen3(seed):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**TINY)).eval().requires_grad_(False)


def raw_logprobs(model, tokens, n_prompt):
    """Temperature-1 log-probs of tokens[n_prompt:] under `model` (one full forward)."""
    with torch.no_grad():
        lp = model(input_ids=torch.tensor([tokens])).logits[0].log_softmax(-1)
    return torch.tensor([float(lp[j - 1, tokens[j]]) for j in range(n_prompt, len(tokens))])


def rounded(seed):
    model = qwen3(seed)
    install_rounding(model, "fp8", "per_tensor")
    return model


def test_engine_rounds_at_load_and_after_each_update(tmp_path):
    qwen3(0).save_pretrained(tmp_path)
    config = EmbeddedEngineConfig(model_dir=str(tmp_path), num_threads=1, max_batch_size=2,
                                  quantize="fp8", quantize_scale="per_tensor")
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, return_raw_logprobs=True)

    def check(seed):
        (r,) = generate(engine, [GenerateRequest(PROMPT, params)], timeout_s=120)
        tokens = PROMPT + r.output_ids
        got = torch.tensor(r.raw_logprobs)
        torch.testing.assert_close(got, raw_logprobs(rounded(seed), tokens, len(PROMPT)), atol=ATOL, rtol=0)
        assert (got - raw_logprobs(qwen3(seed), tokens, len(PROMPT))).abs().max() > 100 * ATOL

    with EmbeddedEngine(config) as engine:
        check(0)
        engine.update_weights(qwen3(1).state_dict(), version=1)
        engine.update_weights(qwen3(2).state_dict(), version=2)  # idle engine: no forward between the swaps
        check(2)
