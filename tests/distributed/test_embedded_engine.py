"""The embedded engine against HF transformers: greedy = generate, exact log-probs, in-flight updates.

One engine process (fp32 tiny Llama, batch of 4 so requests join and leave) serves
the process tests; tests that change its weights put the original ones back.
The decoder and the weight stage are also driven in-process (Qwen3 with tied
embeddings, bf16, KV recomputation after a swap).
"""

import datetime
import inspect
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from entr_megatron.rollout.decoder import BatchDecoder
from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig
from entr_megatron.rollout.engine import (
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    WeightReceiver,
    generate,
)
from entr_megatron.rollout.hf_model import CausalLM, eos_token_ids
from entr_megatron.rollout.sampling import row_params, sampling_logprobs
from entr_megatron.rollout.weights import WeightBucket, WeightStage, pack_buckets
from entr_megatron.types import TrainBatch
from entr_megatron.utils.spawn import free_port

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024,
    # Logits of a few units: fp32 noise between any two ways of computing them (HF's own generate vs
    # its full forward included) stays ~1e-6, under the 1e-5 tolerance; at 0.3 it reaches 2.6e-5.
    initializer_range=0.1,
)
_FORWARD = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
CACHE_KW = "cache" if "cache" in _FORWARD else "past_key_values"  # transformers 5.x / 4.x
PROMPTS = [[5, 17, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], [7, 7, 7, 7, 7, 7], [90, 12, 33, 44, 55, 66, 77, 88]]
GLOO_TIMEOUT = datetime.timedelta(seconds=60)
TIE_ATOL = 1e-5  # greedy checks accept a near-tie at fp32 noise level


def llama(seed):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    llama(0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = EmbeddedEngine(
        EmbeddedEngineConfig(model_dir=model_dir, num_threads=1, max_batch_size=4, update_timeout_s=120)
    )
    yield eng
    eng.shutdown()
    assert not eng.health().alive


@torch.no_grad()
def full_logits(model, tokens):
    """fp32 logits [L, V] of one unpadded sequence: position j predicts token j + 1."""
    return model(input_ids=torch.tensor([tokens])).logits[0].float()


def response_logits(model, r):
    return full_logits(model, r.prompt_ids + r.output_ids)[len(r.prompt_ids) - 1:-1]


def assert_greedy_consistent(logits_TV, tokens, where=""):
    """Each token is the argmax (up to a fp32 near-tie) of its row."""
    chosen = logits_TV.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    gap = logits_TV.max(-1).values - chosen
    assert (gap <= TIE_ATOL).all(), f"{where}: not greedy at positions {(gap > TIE_ATOL).nonzero().flatten().tolist()}"


def assert_raw_logprobs(logits_TV, r, t0=0, t1=None):
    ref = torch.log_softmax(logits_TV.double(), -1).gather(-1, torch.tensor(r.output_ids[t0:t1])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(r.raw_logprobs[t0:t1], dtype=torch.float64), ref, atol=1e-5, rtol=0)


def hf_generate(model, prompt, max_new_tokens):
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


# --- through the engine process ----------------------------------------------------------


def test_greedy_equals_hf_generate(engine, hf_model):
    """5 prompts of different lengths, batch of 4 (one joins later), different max_new_tokens."""
    assert isinstance(engine, RolloutEngine)
    version = engine.weight_version
    max_new = [12, 9, 16, 5, 11]
    requests = [
        GenerateRequest(p, SamplingParams(temperature=0.0, max_new_tokens=m, return_raw_logprobs=True), group_id=i)
        for i, (p, m) in enumerate(zip(PROMPTS, max_new))
    ]
    results = generate(engine, requests, timeout_s=120)
    eos = set(eos_token_ids(hf_model))
    for i, r in enumerate(results):
        assert r.output_ids == hf_generate(hf_model, PROMPTS[i], max_new[i]), f"prompt {i}"
        assert r.finish_reason == ("stop" if r.output_ids[-1] in eos else "length")
        assert r.versions == [version] * len(r.output_ids) and r.group_id == i
        logits = response_logits(hf_model, r)
        assert_raw_logprobs(logits, r)
        # Greedy rows report the T = 1 distribution over the whole vocabulary, as SGLang does.
        log_p = torch.log_softmax(logits.double(), -1)
        chosen = log_p.gather(-1, torch.tensor(r.output_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), chosen, atol=1e-5, rtol=0)
        entropy = -(log_p.exp() * log_p).sum(-1)
        torch.testing.assert_close(torch.tensor(r.entropy, dtype=torch.float64), entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, -1), (0.7, 1.0, -1), (1.0, 0.9, -1), (0.7, 0.9, 20)])
def test_sampled_logprobs_and_entropy_match_hf_forward(engine, hf_model, temperature, top_p, top_k):
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=10, n=2, seed=11, ignore_eos=True
    )
    results = generate(engine, [GenerateRequest(p, params, group_id=i) for i, p in enumerate(PROMPTS[:3])])
    assert len(results) == 6 and all(len(r.output_ids) == 10 and r.finish_reason == "length" for r in results)
    for r in results:
        logits = response_logits(hf_model, r)
        log_q = sampling_logprobs(logits, *row_params([params] * logits.shape[0])).double()
        tokens = torch.tensor(r.output_ids)
        chosen = log_q.gather(-1, tokens[:, None]).squeeze(-1)
        assert torch.isfinite(chosen).all(), "a token outside the truncated support"
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), chosen, atol=1e-5, rtol=0)
        entropy = -(log_q.exp() * log_q.masked_fill(~torch.isfinite(log_q), 0)).sum(-1)
        torch.testing.assert_close(torch.tensor(r.entropy, dtype=torch.float64), entropy, atol=1e-5, rtol=0)
    batch = TrainBatch.from_samples([r.to_sample() for r in results], torch.zeros(len(results)))
    assert batch.rollout_entropy_T is not None and int(batch.loss_mask_T.sum()) == 60


def test_seeded_samples_reproduce_whatever_the_batch(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=5, ignore_eos=True)
    alone = generate(engine, [GenerateRequest(PROMPTS[1], params)])
    crowded = generate(engine, [GenerateRequest(p, params) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[3])])
    assert [r.output_ids for r in alone] == [r.output_ids for r in crowded[2:4]]
    assert alone[0].output_ids != alone[1].output_ids  # the n samples differ


def test_stop_tokens_and_max_new_tokens(engine, hf_model):
    greedy = hf_generate(hf_model, PROMPTS[4], 12)
    stop = greedy[4]
    cut = greedy.index(stop) + 1
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,))
    [stopped] = generate(engine, [GenerateRequest(PROMPTS[4], params)])
    assert stopped.output_ids == greedy[:cut] and stopped.finish_reason == "stop"
    params = SamplingParams(temperature=0.7, max_new_tokens=3, ignore_eos=True)
    [short] = generate(engine, [GenerateRequest(PROMPTS[4], params)])
    assert len(short.output_ids) == len(short.logprobs) == len(short.versions) == 3 and short.finish_reason == "length"


def wait_for(predicate, timeout_s=60.0, what=""):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_abort_running_and_waiting_requests(engine):
    start = engine.health().generated_tokens
    [long_id] = engine.submit([GenerateRequest([3, 4], SamplingParams(max_new_tokens=900, ignore_eos=True, seed=1))])
    wait_for(lambda: engine.health().generated_tokens >= start + 5, what="first tokens")
    engine.pause()
    paused = engine.health()
    assert paused.paused and paused.num_running == 1
    [waiting_id] = engine.submit([GenerateRequest([5], SamplingParams(max_new_tokens=4, n=2))])
    time.sleep(0.05)
    assert engine.health().generated_tokens == paused.generated_tokens  # paused: nothing runs
    engine.abort([long_id, waiting_id])
    results = []
    wait_for(lambda: results.extend(engine.poll(timeout=0.5)) or len(results) == 3, what="aborted results")
    engine.resume()
    by_id = {(r.request_id, r.sample_index): r for r in results}
    running = by_id[(long_id, 0)]
    assert running.finish_reason == "abort" and 5 <= len(running.output_ids) < 900
    assert len(running.logprobs) == len(running.versions) == len(running.entropy) == len(running.output_ids)
    for i in range(2):
        assert by_id[(waiting_id, i)].finish_reason == "abort" and by_id[(waiting_id, i)].output_ids == []
    [after] = generate(engine, [GenerateRequest([5], SamplingParams(max_new_tokens=4, ignore_eos=True))])
    assert len(after.output_ids) == 4


class StateDictReceiver(WeightReceiver):
    """A plugged-in transport: receives in place through `stage.buffer` (as a broadcast would)."""

    def __init__(self, state_dict):
        self.state_dict = state_dict

    def receive(self, stage):
        for name, tensor in self.state_dict.items():
            stage.buffer(name).copy_(tensor)


def test_in_flight_update_during_a_long_generation(engine, hf_model):
    """Weights change mid-response: versions switch once, nothing is dropped or duplicated,
    tokens before follow the old weights and tokens after follow the new weights on top of the
    KV cache the old ones computed (kv_on_update="keep")."""
    v0, n_new = engine.weight_version, 160
    new_model = llama(1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    start = engine.health().generated_tokens
    params = SamplingParams(temperature=0.0, max_new_tokens=n_new, ignore_eos=True, return_raw_logprobs=True)
    [rid] = engine.submit([GenerateRequest(prompt, params)])
    try:
        wait_for(lambda: engine.health().generated_tokens >= start + 10, what="first tokens")
        report = engine.update_weights(new_model.state_dict(), version=v0 + 1)
        assert engine.weight_version == v0 + 1 == report.version
        assert report.running_at_swap == 1 and report.num_tensors == len(new_model.state_dict())
        assert report.swap_s < report.transfer_s < report.total_s
        results = []
        wait_for(lambda: results.extend(engine.poll(timeout=0.5)) or results, what="the long response")
    finally:
        engine.update_weights(StateDictReceiver(hf_model.state_dict()), version=engine.weight_version + 1)
    assert engine.weight_version == v0 + 2
    [r] = results
    assert r.request_id == rid and len(r.output_ids) == len(r.versions) == len(r.raw_logprobs) == n_new
    k = r.versions.index(v0 + 1)
    assert 0 < k < n_new and r.versions == [v0] * k + [v0 + 1] * (n_new - k)

    old = response_logits(hf_model, r)
    assert_greedy_consistent(old[:k], r.output_ids[:k], "before the swap")
    assert_raw_logprobs(old[:k], r, 0, k)
    # After: the new weights continue from the cache the old weights built over prompt + output[:k-1].
    cache = {CACHE_KW: transformers.DynamicCache(), "use_cache": True}
    with torch.no_grad():
        hf_model(input_ids=torch.tensor([prompt + r.output_ids[:k - 1]]), **cache)
        new = new_model(input_ids=torch.tensor([r.output_ids[k - 1:-1]]), **cache).logits[0]
    assert_greedy_consistent(new, r.output_ids[k:], "after the swap")
    assert_raw_logprobs(new, r, k)
    assert (new.log_softmax(-1) - old[k:].log_softmax(-1)).abs().max() > 0.1  # the swap took effect


def broadcast_weights(port, state_dict, bucket_bytes, errors):
    """The learner's side, rank 0 of a two-rank gloo group: HF-named buckets, one broadcast each."""
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=GLOO_TIMEOUT
        )
        for bucket in pack_buckets(state_dict.items(), bucket_bytes):
            dist.broadcast_object_list([bucket.entries], src=0)
            dist.broadcast(bucket.flat, src=0)
        dist.broadcast_object_list([None], src=0)
    except BaseException as e:
        errors.append(e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class GlooReceiver(WeightReceiver):
    """Rank 1 of that group, inside the engine: what the weight_sync transport plugs in."""

    def __init__(self, port):
        self.port = port

    def receive(self, stage):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{self.port}", rank=1, world_size=2, timeout=GLOO_TIMEOUT
        )
        try:
            while True:
                meta = [None]
                dist.broadcast_object_list(meta, src=0)
                if meta[0] is None:
                    return
                bucket = WeightBucket.allocate(meta[0])
                dist.broadcast(bucket.flat, src=0)
                stage.load_bucket(bucket)
        finally:
            dist.destroy_process_group()


def test_weights_broadcast_from_another_process(engine, hf_model, monkeypatch):
    """This (test) process broadcasts a new version over gloo while the engine generates; the
    engine swaps it in between two steps and then computes what the new weights compute."""
    v0, new_model = engine.weight_version, llama(1)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    port, errors = free_port(), []
    sender = threading.Thread(target=broadcast_weights, args=(port, new_model.state_dict(), 30_000, errors))
    params = SamplingParams(temperature=0.0, max_new_tokens=6, return_raw_logprobs=True, ignore_eos=True)
    try:
        busy = engine.submit([GenerateRequest([2, 7], SamplingParams(max_new_tokens=300, ignore_eos=True))])
        sender.start()
        report = engine.update_weights(GlooReceiver(port), version=v0 + 1)
        sender.join(timeout=60)
        assert not errors and report.version == engine.weight_version == v0 + 1
        [r] = generate(engine, [GenerateRequest(PROMPTS[1], params)])
        engine.abort(busy)
    finally:
        engine.update_weights(hf_model.state_dict(), version=engine.weight_version + 1)
    assert r.versions == [v0 + 1] * 6
    logits = response_logits(new_model, r)
    assert_greedy_consistent(logits, r.output_ids, "new weights")
    assert_raw_logprobs(logits, r)
    wait_for(lambda: engine.health().num_running == 0, what="the aborted request")
    engine.poll()


def test_rejected_updates_leave_the_engine_as_it_was(engine, hf_model):
    v = engine.weight_version
    sd = hf_model.state_dict()
    with pytest.raises(ValueError, match="must increase"):
        engine.update_weights(sd, version=v)
    with pytest.raises(ValueError, match="unknown tensors"):
        engine.update_weights({**sd, "model.extra.weight": torch.zeros(2)}, version=v + 1)
    name = next(iter(sd))
    with pytest.raises(ValueError, match="incomplete"):  # an iterable: only the engine can tell
        engine.update_weights(((n, t * 0) for n, t in sd.items() if n != name), version=v + 1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(((n, t[:1] if n == name else t) for n, t in sd.items()), version=v + 1)
    assert engine.weight_version == v and engine.health().weight_version == v
    [r] = generate(engine, [GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=6))])
    assert r.output_ids == hf_generate(hf_model, PROMPTS[0], 6) and r.versions == [v] * len(r.output_ids)



class StuckReceiver(WeightReceiver):
    """Writes zeros into one tensor of the stage, then waits, as a receive whose relay died does,
    until the engine is told to give the version up (`cancel`, in the engine's process)."""

    def receive(self, stage):
        self.cancelled = threading.Event()  # made in the engine's process (a receiver must pickle)
        stage.buffer(next(iter(stage.specs))).zero_()
        if not self.cancelled.wait(60):
            raise AssertionError("never cancelled")
        raise ValueError("weight version cancelled (test)")

    def cancel(self):
        self.cancelled.set()


def test_an_update_waiting_for_a_lost_member_is_cancelled_and_the_engine_keeps_its_weights(engine, hf_model):
    """`cancel_weight_update` (what the controller does once another engine of the broadcast group
    failed) reaches the receiver in the engine's process between two decode steps: the update
    raises its message within seconds, the engine samples from the weights it held, and the next
    update goes through."""
    v = engine.weight_version
    outcome = {}

    def update():
        try:
            outcome["report"] = engine.update_weights(StuckReceiver(), version=v + 1)
        except Exception as e:  # noqa: BLE001
            outcome["error"] = e

    waiting = threading.Thread(target=update, daemon=True)
    busy = engine.submit([GenerateRequest([2, 7], SamplingParams(max_new_tokens=300, ignore_eos=True))])
    waiting.start()
    waiting.join(timeout=2)
    assert waiting.is_alive()  # the receive waits
    t0 = time.monotonic()
    engine.cancel_weight_update()
    waiting.join(timeout=30)
    assert not waiting.is_alive() and time.monotonic() - t0 < 10
    assert isinstance(outcome.get("error"), ValueError) and "cancelled (test)" in str(outcome["error"])
    engine.abort(busy)
    assert engine.weight_version == engine.health().weight_version == v
    [r] = generate(engine, [GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=6))])
    assert r.output_ids == hf_generate(hf_model, PROMPTS[0], 6) and r.versions == [v] * len(r.output_ids)
    engine.update_weights(StateDictReceiver(hf_model.state_dict()), version=v + 1)
    assert engine.weight_version == v + 1
    engine.cancel_weight_update()  # nothing in progress: no effect
    assert engine.health().alive and engine.weight_version == v + 1
    wait_for(lambda: engine.health().num_running == 0, what="the aborted request")
    engine.poll()


def test_after_forget_version_one_update_may_go_back(engine, hf_model):
    """A learner relaunched from an older checkpoint pushes a version below the engine's (controller/job/run.py)."""
    sd, v = hf_model.state_dict(), engine.weight_version
    engine.update_weights(sd, version=v + 2)
    engine.forget_version()
    engine.update_weights(sd, version=v + 1)
    assert engine.weight_version == engine.health().weight_version == v + 1
    with pytest.raises(ValueError, match="must increase"):  # once only
        engine.update_weights(sd, version=v + 1)
    [r] = generate(engine, [GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=6))])
    assert r.versions == [v + 1] * len(r.output_ids)

# --- in-process: the decoder and the weight stage ----------------------------------------


def run(decoder, steps=None):
    results = []
    while decoder.has_work() and (steps is None or steps > 0):
        results += decoder.step()
        steps = None if steps is None else steps - 1
    return results


def test_qwen3_tied_greedy_and_a_staged_swap_with_kv_recompute():
    """Qwen3 (q/k norms, tied embeddings): greedy = generate; then a swap mid-generation through
    multi-bucket staging (tied names share one tensor) and a recomputed KV cache: tokens after the
    swap are the new model's greedy continuation of the whole prefix."""
    cfg = transformers.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    torch.manual_seed(3)
    new_model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    reference = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    reference.load_state_dict(model.state_dict())

    decoder = BatchDecoder(model, max_batch_size=2, eos_token_ids=())
    for i, p in enumerate(PROMPTS[:3]):
        decoder.add(GenerateRequest(p, SamplingParams(temperature=0.0, max_new_tokens=10), request_id=str(i)))
    for r in run(decoder):
        assert r.output_ids == hf_generate(reference, r.prompt_ids, 10)

    stage = WeightStage(model)
    assert stage.num_tensors == len(model.state_dict()) - 1  # lm_head.weight is embed_tokens.weight
    params = SamplingParams(temperature=0.0, max_new_tokens=30, return_raw_logprobs=True)
    decoder.add(GenerateRequest(PROMPTS[1], params, request_id="long"))
    run(decoder, steps=8)
    stage.begin(1)
    named = [(n, t) for n, t in new_model.state_dict().items() if n != "lm_head.weight"]
    buckets = list(pack_buckets(named, bucket_bytes=20_000))
    assert len(buckets) > 3
    for b in buckets:
        stage.load_bucket(b)
    stage.finish()
    decoder.version = stage.swap_into()
    decoder.recompute_cache()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, new_model.lm_head.weight, atol=0, rtol=0)
    [r] = run(decoder)
    assert r.versions == [0] * 8 + [1] * 22
    assert_greedy_consistent(response_logits(reference, r)[:8], r.output_ids[:8], "before")
    after = response_logits(new_model, r)[8:]
    assert_greedy_consistent(after, r.output_ids[8:], "after")
    assert_raw_logprobs(after, r, 8)


def test_bfloat16_decoder_equals_bfloat16_generate():
    """One request at a time (no padding, batch 1): the same bf16 ops as generate."""
    model = llama(4).to(torch.bfloat16)
    decoder = BatchDecoder(model, eos_token_ids=())
    decoder.add(GenerateRequest(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=12), request_id="a"))
    [greedy] = run(decoder)
    assert greedy.output_ids == hf_generate(model, PROMPTS[1], 12)
    decoder.add(GenerateRequest(PROMPTS[1], SamplingParams(temperature=1.0, max_new_tokens=12, seed=0), request_id="b"))
    [sampled] = run(decoder)
    assert all(-30 < lp <= 0 for lp in sampled.logprobs) and all(h > 0 for h in sampled.entropy)
    assert CausalLM(model).vocab_size == TINY["vocab_size"]


def test_qwen3_moe_batched_greedy_equals_generate():
    """Experts routed per token: left padding in the batch changes nothing for real tokens."""
    cfg = transformers.Qwen3MoeConfig(
        **{**TINY, "intermediate_size": 96}, head_dim=16, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1,
    )
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    decoder = BatchDecoder(model, max_batch_size=3, eos_token_ids=())
    for i, p in enumerate(PROMPTS[:4]):
        decoder.add(GenerateRequest(p, SamplingParams(temperature=0.0, max_new_tokens=8), request_id=str(i)))
    for r in run(decoder):
        assert r.output_ids == hf_generate(model, r.prompt_ids, 8), r.request_id


DEEPSEEK_ROUTER = dict(moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                       first_k_dense_replace=1, routed_scaling_factor=2.5)


@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3"])
def test_deepseek_style_models_load_and_greedy_equals_generate(model_type, tmp_path):
    """GLM-4.5 (partial RoPE, q/k/v bias, q/k norms) and DeepSeek-V3 (MLA: the cache holds the
    compressed latents; YaRN): the engine's loader and batched decoder (left padding, merged caches)
    give HF generate's tokens; the stage takes exactly the names the learner sends (the router's
    score-correction bias, a buffer, included)."""
    from entr_megatron import models
    from entr_megatron.rollout.hf_model import load_causal_lm

    tiny = {**TINY, "intermediate_size": 96}
    cfg = (transformers.Glm4MoeConfig(**tiny, **DEEPSEEK_ROUTER, head_dim=16, use_qk_norm=True, attention_bias=True)
           if model_type == "glm4_moe" else
           transformers.DeepseekV3Config(**(tiny | dict(num_key_value_heads=4)), **DEEPSEEK_ROUTER, q_lora_rank=32,
                                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                         rope_scaling=dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                                                           original_max_position_embeddings=256)))
    torch.manual_seed(6)
    reference = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    for name, b in reference.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn_like(b))
    reference.save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path))
    decoder = BatchDecoder(model, max_batch_size=3, eos_token_ids=())
    for i, p in enumerate(PROMPTS[:4]):
        decoder.add(GenerateRequest(p, SamplingParams(temperature=0.0, max_new_tokens=6), request_id=str(i)))
    for r in run(decoder):
        assert r.output_ids == hf_generate(reference, r.prompt_ids, 6), r.request_id
    spec = models.model_spec(cfg)
    assert set(WeightStage(model).specs) == set(models.hf_names(spec, "transformers"))


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="EmbeddedEngineConfig.dtype"):
        EmbeddedEngineConfig(model_dir=str(tmp_path), dtype="float16")
    with pytest.raises(ValueError, match="EmbeddedEngineConfig.kv_on_update"):
        EmbeddedEngineConfig(model_dir=str(tmp_path), kv_on_update="drop")
    for device in ("gpu", "cuda:", "cuda:x", "mps"):
        with pytest.raises(ValueError, match=r"EmbeddedEngineConfig\.device must be 'cpu', 'cuda' or 'cuda:N'"):
            EmbeddedEngineConfig(model_dir=str(tmp_path), device=device)
    assert EmbeddedEngineConfig(model_dir=str(tmp_path), device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="no config.json"):  # before any process is spawned
        EmbeddedEngine(EmbeddedEngineConfig(model_dir=str(tmp_path)))


class TiedModule(torch.nn.Module):
    """Tied weights, odd byte sizes, a bf16 parameter and a persistent buffer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 3)
        self.out = torch.nn.Linear(3, 7, bias=False)
        self.out.weight = self.emb.weight
        self.norm = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))
        self.register_buffer("scale", torch.ones(3))


def test_buckets_and_stage_swap_atomically_without_copies():
    model = TiedModule()
    stage = WeightStage(model)
    assert stage.num_tensors == 3 and set(stage.specs) == {"emb.weight", "out.weight", "norm", "scale"}
    emb_param, before = model.emb.weight, {n: t.clone() for n, t in model.state_dict().items()}
    for version in (1, 2):  # the second version lands in the storage the first one replaced
        new = {"emb.weight": torch.randn(7, 3), "norm": torch.randn(5), "scale": torch.randn(3)}
        stage.begin(version)
        buckets = list(pack_buckets(new.items(), bucket_bytes=40, dtypes={"norm": torch.bfloat16}))
        assert len(buckets) == 3 and buckets[1].entries[0].dtype == torch.bfloat16
        for b in buckets:
            stage.load_bucket(b)
        torch.testing.assert_close(model.state_dict(), before, atol=0, rtol=0)  # staged, not installed
        stage.finish()
        assert stage.swap_into() == version
        assert model.emb.weight is emb_param and model.out.weight is emb_param
        torch.testing.assert_close(model.emb.weight.data, new["emb.weight"], atol=0, rtol=0)
        torch.testing.assert_close(model.norm.data, new["norm"].bfloat16(), atol=0, rtol=0)
        torch.testing.assert_close(model.scale, new["scale"], atol=0, rtol=0)
        before = {n: t.clone() for n, t in model.state_dict().items()}
    stage.begin(3)
    stage.buffer("out.weight").fill_(1.0)  # the tied name fills the shared slot
    stage.write("norm", torch.zeros(5))
    with pytest.raises(ValueError, match="incomplete: 1 of 3 tensors missing"):
        stage.finish()
    with pytest.raises(ValueError, match="shape"):
        stage.begin(4)
        stage.write("norm", torch.zeros(6))
    stage.discard()
    torch.testing.assert_close(model.state_dict(), before, atol=0, rtol=0)



def _wire_bucket(named, bucket_bytes=1 << 20):
    """(entries, flat) of each bucket as the weight-sync wire packs it (no padding)."""
    from entr_megatron.weight_sync.buckets import plan_buckets

    out = []
    for layout, tensors in plan_buckets(named, bucket_bytes):
        flat = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.fill(flat, tensors)
        out.append((layout.entries(), flat))
    return out


def test_buckets_land_in_the_stage_in_place():
    """`bucket_buffer`: a flat bucket received straight into the staged tensors (no copy); from the
    third version on, the same layout reuses the storage the swap handed back; versions stay atomic."""
    model = TiedModule()
    stage = WeightStage(model)
    flats = []
    for version in (1, 2, 3, 4):
        new = {"emb.weight": torch.randn(7, 3), "norm": torch.randn(5).bfloat16(), "scale": torch.randn(3)}
        before = {n: t.clone() for n, t in model.state_dict().items()}
        stage.begin(version)
        [(entries, flat)] = _wire_bucket(new.items())
        target = stage.bucket_buffer(entries, flat.numel())
        assert target is not None and target.dtype == torch.uint8 and target.numel() == flat.numel()
        target.copy_(flat)  # what the broadcast does
        with pytest.raises(ValueError, match="incomplete"):
            stage.finish()  # not written before commit_bucket
        stage.begin(version)
        again = stage.bucket_buffer(entries, flat.numel())
        assert again.data_ptr() == target.data_ptr()  # the layout is kept
        again.copy_(flat)
        stage.commit_bucket(entries)
        torch.testing.assert_close(model.state_dict(), before, atol=0, rtol=0)  # staged, not installed
        stage.finish()
        assert stage.swap_into() == version
        assert model.out.weight is model.emb.weight
        torch.testing.assert_close(model.emb.weight.data, new["emb.weight"], atol=0, rtol=0)
        torch.testing.assert_close(model.norm.data, new["norm"], atol=0, rtol=0)
        torch.testing.assert_close(model.scale, new["scale"], atol=0, rtol=0)
        flats.append(target.data_ptr())
    assert flats[2] == flats[0] and flats[3] == flats[1] and flats[0] != flats[1]  # two flat copies alternate
    # Buckets that cannot land in place: the caller copies them (`load_bucket` reports what is wrong).
    stage.begin(5)
    cases = [
        _wire_bucket([("norm", torch.randn(5))]),  # fp32 on the wire, bf16 staged
        _wire_bucket([("emb.weight", torch.randn(7, 3)), ("out.weight", torch.randn(7, 3))]),  # one tied tensor twice
        _wire_bucket([("nope", torch.randn(2))]),
        _wire_bucket([("scale", torch.randn(4))]),
        [(b.entries, b.flat) for b in pack_buckets([("emb.weight", torch.randn(7, 3)), ("scale", torch.randn(3))], 1 << 20)],
    ]
    for [(entries, flat)] in cases:
        assert stage.bucket_buffer(entries, flat.numel()) is None
    stage.load_bucket(WeightBucket(*cases[0][0]))
    with pytest.raises(ValueError, match="unknown tensor"):
        stage.load_bucket(WeightBucket(*cases[2][0]))
    stage.discard()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    stage.begin(6)  # a partial version in place: discarded, the model untouched
    [(entries, flat)] = _wire_bucket([("emb.weight", torch.zeros(7, 3))])
    stage.bucket_buffer(entries, flat.numel()).copy_(flat)
    stage.commit_bucket(entries)
    with pytest.raises(ValueError, match="incomplete"):
        stage.finish()
    torch.testing.assert_close(model.state_dict(), before, atol=0, rtol=0)
