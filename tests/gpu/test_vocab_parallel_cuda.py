"""The vocab-parallel op on a CUDA device (one rank) against float64; skipped without CUDA."""

import pytest
import torch

from entr_megatron.parallel import vocab_parallel_logprobs_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cuda_matches_float64(dtype, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 3, 1000, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, 1000, (64, 3), generator=gen)
    g_lp, g_h = torch.randn(64, 3, generator=gen), torch.randn(64, 3, generator=gen)

    x = logits.cuda().requires_grad_()
    lp, ent = vocab_parallel_logprobs_entropy(x, targets.cuda(), temperature=temperature, chunk_size=7)
    (lp * g_lp.cuda() + ent * g_h.cuda()).sum().backward()

    ref = logits.double().requires_grad_()
    logp = torch.log_softmax(ref / temperature, -1)
    ref_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_h = -(logp.exp() * logp).sum(-1)
    (ref_lp * g_lp.double() + ref_h * g_h.double()).sum().backward()

    torch.testing.assert_close(lp.cpu().double(), ref_lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.cpu().double(), ref_h.detach(), atol=1e-5, rtol=0)
    tol = dict(atol=1e-5, rtol=0) if dtype == torch.float32 else dict(atol=1e-3, rtol=8e-3)
    torch.testing.assert_close(x.grad.cpu().double(), ref.grad, **tol)
