"""tools/tail_precondition.py's counts on a hand-built set of tokens: which are rare at low entropy,
which of them cross ENTR's threshold, IcePop's band and DPPO's, per 1k response tokens."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("tail_precondition")


def test_counts_and_crossings_by_hand(tool):
    # (mu, H(mu), pi) per token; tau 1, eps 0.01: ENTR's bound at H = 0.05 is sqrt(0.06) = 0.245
    tokens = [
        (0.005, 0.05, 0.005 * math.exp(0.5)),   # rare, low H, |delta| 0.5: crosses ENTR, inside IcePop's band
        (0.005, 0.05, 0.005 * math.exp(0.05)),  # rare, low H, |delta| 0.05: crosses nothing
        (0.002, 0.02, 0.002 * math.exp(-0.9)),  # rare, low H, delta -0.9: ENTR (bound 0.173) and IcePop (< log 0.5)
        (0.005, 0.50, 0.005 * math.exp(0.5)),   # rare but H 0.5: not counted
        (0.900, 0.05, 0.500),                   # low H but common: not counted; DPPO (|0.5 - 0.9| > 0.15)
    ] + [(0.99, 0.05, 0.99)] * 995              # 1000 tokens in all
    samples = [([1], [7] * len(tokens), [math.log(m) for m, _, _ in tokens], [h for _, h, _ in tokens])]
    log_pi = torch.tensor([math.log(p) for _, _, p in tokens], dtype=torch.float64)
    out = tool.measure(samples, log_pi, torch.zeros_like(log_pi), tau=1.0, eps=0.01)
    assert out["response_tokens"] == 1000
    assert out["rare_low_h_per_1k"] == pytest.approx(3.0)
    assert out["low_h_share"] == pytest.approx(0.999)  # all but the H 0.5 token
    # the ceiling: sum of H(mu) over low-H positions / ln(1 / 0.01), per 1k tokens
    assert out["rare_low_h_ceiling_per_1k"] == pytest.approx((998 * 0.05 + 0.02) / math.log(100))
    assert out["rare_low_h_entr_per_1k"] == pytest.approx(2.0) and out["holds"]
    shares = out["share_of_rare_low_h"]
    assert shares["entr (H mu)"] == pytest.approx(2 / 3) and shares["icepop band"] == pytest.approx(1 / 3)
    assert shares["dppo tv"] == 0.0
    # with H(pi) = 0 the bound is sqrt(0.01) = 0.1: |delta| 0.5 and 0.9 cross it, 0.05 does not
    assert shares["entr (H pi)"] == pytest.approx(2 / 3)
    assert out["masked_per_1k_all_tokens"]["dppo tv"] == pytest.approx(1.0)
    assert out["rare_low_h_abs_delta"]["max"] == pytest.approx(0.9)
    cell = next(b for b in out["bins"] if b["H"] == [0.01, 0.1] and b["mu"] == [1e-3, 1e-2])
    assert cell["tokens"] == 3 and cell["entr_share"] == pytest.approx(2 / 3)
    assert sum(b["tokens"] for b in out["bins"]) == 1000


def test_one_crossing_per_1k_does_not_hold(tool):
    tokens = [(0.005, 0.05, 0.005 * math.exp(0.5))] + [(0.99, 0.05, 0.99)] * 999
    samples = [([1], [7] * 1000, [math.log(m) for m, _, _ in tokens], [h for _, h, _ in tokens])]
    log_pi = torch.tensor([math.log(p) for _, _, p in tokens], dtype=torch.float64)
    out = tool.measure(samples, log_pi, torch.zeros_like(log_pi), tau=1.0, eps=0.01)
    assert out["rare_low_h_entr_per_1k"] == pytest.approx(1.0) and not out["holds"]
    assert "| [0.01, 0.1) |" in tool.markdown({"title": "t", "setup": "s", "rows": [
        {"source": "numerics", "engine": "bf16", **out}]})


def test_decode_all_is_hf_greedy_decoding_in_prompt_order():
    """rollout.decoder.decode_all (the tools' sampler): greedy, its tokens are HF generate's, one
    result per sample in prompt order then sample index, prompts batched beyond max_batch_size."""
    import transformers

    from entr_megatron.rollout.decoder import decode_all
    from entr_megatron.rollout.engine import SamplingParams

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=48, vocab_size=64, initializer_range=0.3,
                                   max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    prompts = [[5, 6, 7], [9], [3, 4, 5, 6, 7, 8], [11, 12]]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, n=2, ignore_eos=True)
    results = decode_all(model, prompts, params, max_batch_size=3, eos_token_ids=())
    assert [(r.prompt_ids, r.sample_index) for r in results] == [(p, i) for p in prompts for i in range(2)]
    for r in results:
        with torch.no_grad():
            want = model.generate(torch.tensor([r.prompt_ids]), max_new_tokens=6, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)[0, len(r.prompt_ids):]
        assert r.output_ids == want.tolist()


def test_decode_all_gives_each_prompt_its_own_random_stream():
    """A seeded decode_all samples each prompt with its own stream (mix_seed(seed, i)), as the
    evaluation does: the same prompt twice gets different samples, each the one a lone request
    seeded mix_seed(seed, i) gets; the call is deterministic. With one stream for every prompt
    (the old sampler) the two copies' samples were equal token for token."""
    import transformers

    from dataclasses import replace

    from entr_megatron.rollout.decoder import BatchDecoder, decode_all
    from entr_megatron.rollout.engine import GenerateRequest, SamplingParams
    from entr_megatron.utils.seeding import mix_seed

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=48, vocab_size=64, initializer_range=0.3,
                                   max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=3, ignore_eos=True, seed=7)
    results = decode_all(model, [[5, 6, 7], [5, 6, 7]], params, max_batch_size=8, eos_token_ids=())
    first, second = [r.output_ids for r in results[:3]], [r.output_ids for r in results[3:]]
    assert first != second and all(a != b for a, b in zip(first, second))
    for i in (0, 1):  # each prompt's samples are a lone request's seeded mix_seed(7, i)
        dec = BatchDecoder(model, max_batch_size=8, eos_token_ids=())
        dec.add(GenerateRequest([5, 6, 7], replace(params, seed=mix_seed(7, i)), request_id="x"))
        alone = []
        while dec.has_work():
            alone.extend(dec.step())
        assert [r.output_ids for r in sorted(alone, key=lambda r: r.sample_index)] == [first, second][i]
    assert [r.output_ids for r in decode_all(model, [[5, 6, 7], [5, 6, 7]], params, 8, ())] == first + second


def test_counts_by_label_and_the_commonest_rare_tokens_by_hand(tool):
    # (token id, label, mu, H(mu), pi): three rare tokens at low H, two of them token 11
    tokens = [
        (11, "forced", 0.005, 0.05, 0.005 * math.exp(0.5)),   # crosses ENTR (bound 0.245)
        (11, "forced", 0.005, 0.05, 0.005 * math.exp(0.05)),  # does not
        (12, "answer", 0.002, 0.02, 0.002 * math.exp(-0.9)),  # crosses
        (13, "choice", 0.005, 0.50, 0.005),                   # rare at high H: not counted
    ] + [(7, "forced", 0.99, 0.05, 0.99)] * 496 + [(7, "choice", 0.6, 1.2, 0.6)] * 500
    samples = [([1], [t for t, *_ in tokens], [math.log(m) for _, _, m, _, _ in tokens], [h for *_, h, _ in tokens])]
    log_pi = torch.tensor([math.log(p) for *_, p in tokens], dtype=torch.float64)
    out = tool.measure(samples, log_pi, torch.zeros_like(log_pi), tau=1.0, eps=0.01, labels=[x[1] for x in tokens])
    by = out["by_label"]
    assert list(by) == ["forced", "answer", "choice"]
    assert by["forced"]["tokens_per_1k"] == pytest.approx(498) and by["forced"]["low_h_share"] == 1.0
    assert by["forced"]["rare_low_h_per_1k"] == pytest.approx(2) and by["forced"]["rare_low_h_entr_per_1k"] == 1
    assert by["answer"]["rare_low_h_entr_per_1k"] == pytest.approx(1)
    assert by["choice"]["low_h_share"] == 0 and by["choice"]["rare_low_h_per_1k"] == 0
    assert out["rare_low_h_tokens"] == [{"token_id": 11, "per_1k": 2.0, "entr_share": 0.5},
                                        {"token_id": 12, "per_1k": 1.0, "entr_share": 1.0}]
    assert [r[:2] for r in out["_rare_rows"]] == [(11, "forced"), (11, "forced"), (12, "answer")]
    text = tool.markdown({"title": "t", "setup": "s", "rows": [{"source": "both", "engine": "bf16", **out}]})
    assert "| both | bf16 | answer | 1.0 | 1.000 | 1.00 | 1.00 |" in text
    assert '| both | bf16 | 11 "" | 2.00 | 0.50 |' in text


def test_response_labels_are_the_tasks_labels_of_each_prompts_samples(tool):
    """Sample j answers prompt j // n (decode_all's order); each gets its own problem's labels."""
    from entr_megatron.tasks.char_tokenizer import build_char_tokenizer
    from entr_megatron.tasks.countdown import CountdownTask, label_response

    tok = build_char_tokenizer()
    task = CountdownTask(num_operands=3, tokenizer=tok)
    (p0, ref0), (p1, ref1) = task.prompts("test", 2, seed=0)
    texts = ["1+2=", "ans 7", "9*9=81:", "3-"]  # two samples of each prompt, right or not
    samples = [(p, tok.encode(t, add_special_tokens=False), [0.0] * len(t), [0.0] * len(t))
               for p, t in zip([p0, p0, p1, p1], texts)]
    want = [x for ref, t in zip([ref0, ref0, ref1, ref1], texts) for x in label_response(ref, t)]
    assert tool.response_labels(task, [ref0, ref1], samples, n=2) == want
    assert tool.response_labels(object(), [ref0, ref1], samples, n=2) is None
