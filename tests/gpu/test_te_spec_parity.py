"""The learner with TransformerEngine's layer spec on CUDA computes HF's own log-probs.

Skipped without CUDA and TransformerEngine. The CPU suite covers the portable spec
(tests/distributed/test_hf_parity.py); this is the same check on the cluster path:
TE-fused norm names in the HF mapping, TE attention and linears, NCCL.
"""

import os

import pytest
import torch

from entr_megatron.utils.spawn import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            initializer_range=0.3, max_position_embeddings=256, vocab_size=256, intermediate_size=96)
# TE may run fp32 GEMMs through TF32-capable paths; the CPU suite holds 1e-4.
ATOL = 2e-3


@pytest.fixture(scope="module")
def nccl_world():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_te_spec_matches_hf(family, nccl_world, tmp_path):
    pytest.importorskip("transformer_engine")
    from entr_megatron.learner.build import build_learner_model_from_hf
    from entr_megatron.learner.scoring import score_sequences
    from entr_megatron.parallel.groups import destroy, initialize_model_parallel

    cfg = (transformers.LlamaConfig(**TINY, tie_word_embeddings=True) if family == "llama"
           else transformers.Qwen3Config(**TINY, head_dim=16))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = os.path.join(tmp_path, family)
    model.save_pretrained(path)
    seqs = [torch.randint(0, cfg.vocab_size, (n,)) for n in (9, 3, 17)]

    groups = initialize_model_parallel(1, 1)
    try:
        chunks, spec = build_learner_model_from_hf(path, groups, use_te=True)
        results = score_sequences(chunks, spec, groups, [s.tolist() for s in seqs], batch_tokens=16)
    finally:
        destroy()
    with torch.no_grad():
        for s, (lp, ent) in zip(seqs, results):
            logp = torch.log_softmax(model(s[None]).logits[0].double(), dim=-1)[:-1]
            torch.testing.assert_close(lp.double().cpu(), logp.gather(-1, s[1:, None])[:, 0], atol=ATOL, rtol=0)
            torch.testing.assert_close(ent.double().cpu(), -(logp.exp() * logp).sum(-1), atol=ATOL, rtol=0)
