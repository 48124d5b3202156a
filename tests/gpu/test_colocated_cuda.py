"""An embedded engine on the GPU, colocated with its learner (rollout.embedded.device 'cuda'):
CUDA IPC handles open the engine's memory in another process, weights pushed from GPU tensors
land in the engine's GPU staging copy, and the engine's log-probs then match the pushed model's
own forward. Skipped without CUDA (the CPU side of the handoff: tests/distributed/
test_weight_sync_colocated.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig
from entr_megatron.rollout.engine import GenerateRequest, SamplingParams, generate
from entr_megatron.utils.spawn import free_port
from entr_megatron.weight_sync import WeightSync, WeightSyncConfig, receiver_for, stage_groups
from entr_megatron.weight_sync.colocated import ColocatedReceiver, ColocatedTransport, share_handle, staging_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[3, 17, 5, 9], [40, 2], [7, 7, 7, 1, 30, 11]]


def test_a_cuda_handle_opens_the_same_gpu_bytes_in_another_process():
    flat = staging_bytes(1 << 20, torch.device("cuda:0"))
    flat.zero_()
    torch.cuda.synchronize()
    handle = share_handle(flat[4096:8192])
    assert handle["kind"] == "cuda" and handle["nbytes"] == 4096
    code = ("import json, sys, torch; from entr_megatron.weight_sync.colocated import open_handle; "
            "t = open_handle(json.loads(sys.argv[1])); t.copy_((torch.arange(t.numel()) % 251).to(t.device)); "
            "torch.cuda.synchronize()")
    subprocess.run([sys.executable, "-c", code, json.dumps(handle)], check=True, timeout=120)
    want = torch.zeros(1 << 20, dtype=torch.uint8)
    want[4096:8192] = torch.arange(4096) % 251
    assert torch.equal(flat.cpu(), want)


def test_weights_pushed_from_the_gpu_land_in_an_engine_on_the_gpu(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)  # the engine's start
    torch.manual_seed(1)
    learner = transformers.AutoModelForCausalLM.from_config(cfg).cuda().eval()  # what is pushed

    groups = stage_groups("127.0.0.1", free_port(), pp_size=1, backend="gloo")
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_dir=str(tmp_path), device="cuda:0", update_timeout_s=120))
    try:
        r = receiver_for(groups, 0, timeout_s=60)
        transport = ColocatedTransport(groups[0], engines=[(engine, ColocatedReceiver(r.groups, r.rank, 60))],
                                       timeout_s=60)
        sync = WeightSync(lambda: list(learner.state_dict().items()), transport,
                          WeightSyncConfig(bucket_bytes=64 << 10, snapshot="borrow", borrow_min_bytes=1))
        for version in (1, 2):
            report = sync.push(version).wait(timeout=120)
            assert engine.weight_version == version and transport.last_copies == report.num_buckets > 1
        params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3, ignore_eos=True)
        results = generate(engine, [GenerateRequest(p, params) for p in PROMPTS], timeout_s=120)
        health = engine.health()
        sync.close()
    finally:
        engine.shutdown()
    assert health.cache_frees >= 1  # free_cache_engine: emptied on going idle
    for res in results:
        ids = torch.tensor([res.prompt_ids + res.output_ids], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(learner(ids).logits[0].double(), -1)
        k = len(res.prompt_ids) - 1
        want = logp[k:-1].gather(-1, ids[0, k + 1:, None]).squeeze(-1).cpu()
        torch.testing.assert_close(torch.tensor(res.logprobs, dtype=torch.float64), want, atol=2e-3, rtol=0)
        assert set(res.versions) == {2}
