"""The fused output op on one CUDA device: its Triton kernels against float64 and against its
chunked PyTorch path; skipped without CUDA (and the Triton cases without triton)."""

import pytest
import torch

from entr_megatron.parallel import vocab_parallel_linear_logprobs_entropy
from entr_megatron.parallel.triton_env import triton_available, uses_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton")

# Sizes off every tile boundary: 300 tokens, h 200 (not a multiple of BLOCK_K), 5000 rows
# of which the last 37 are padding.
N, H, V, REAL = 300, 200, 5000, 4963


def make_case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 4 / H**0.5).to(dtype)
    targets = torch.randint(0, REAL, (N,), generator=g)
    return hidden, weight, targets, torch.randn(N, generator=g), torch.randn(N, generator=g)


def run(backend, hidden, weight, targets, g_lp, g_h, temperature, **kw):
    x = hidden.cuda().requires_grad_()
    w = weight.cuda().requires_grad_()
    lp, ent, coll = vocab_parallel_linear_logprobs_entropy(
        x, w, targets.cuda(), temperature=temperature, vocab_size=REAL, return_collision=True, backend=backend, **kw
    )
    (lp * g_lp.cuda() + ent * g_h.cuda()).sum().backward()
    return [t.detach().cpu() for t in (lp, ent, coll, x.grad, w.grad)]


def reference_f64(hidden, weight, targets, g_lp, g_h, temperature):
    x = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp = torch.log_softmax(x @ w[:REAL].t() / temperature, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    coll = 1 - logp.exp().square().sum(-1)
    (lp * g_lp.double() + ent * g_h.double()).sum().backward()
    return [lp.detach(), ent.detach(), coll.detach(), x.grad, w.grad]


def assert_relative(got, want, tol, what):
    err = (got.double() - want.double()).abs().max().item()
    scale = max(want.abs().max().item(), 1e-6)
    assert err <= tol * scale, f"{what}: max error {err:.3g}, max |want| {scale:.3g}"


@needs_triton
def test_auto_picks_triton_on_cuda():
    assert uses_triton("auto", torch.zeros(1, device="cuda"))


@needs_triton
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tile", [(None, None), (128, 1000)])
def test_triton_fp32_matches_float64(temperature, tile):
    """fp32 operands run in full fp32 (never TF32): values and gradients to 1e-5."""
    case = make_case(torch.float32)
    got = run("triton", *case, temperature, chunk_tokens=tile[0], chunk_vocab=tile[1])
    want = reference_f64(*case, temperature)
    for name, g, w in zip(("logprob", "entropy", "collision"), got[:3], want[:3]):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=0, msg=name)
    assert_relative(got[3], want[3], 1e-5, "grad hidden")
    assert_relative(got[4], want[4], 1e-5, "grad weight")
    assert not got[4][REAL:].any(), "padding rows get no gradient"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_16bit_matches_the_torch_path(dtype):
    """Both paths round fp32-accumulated logits to the input dtype, but cuBLAS and the Triton
    kernel sum in different orders, so a logit may round to the neighbouring 16-bit value:
    values agree to two ulps of the largest |logit| / T, gradients to 2% of their largest entry."""
    case = make_case(dtype, seed=1)
    got = run("triton", *case, 0.8)
    want = run("torch", *case, 0.8)
    z_max = (case[0].float() @ case[1].float().t()).abs().max().item()
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)  # relative spacing of the 16-bit type, rounded up
    for name, g, w in zip(("logprob", "entropy", "collision"), got[:3], want[:3]):
        torch.testing.assert_close(g, w, atol=2 * ulp * z_max / 0.8, rtol=0, msg=f"{dtype} {name}")
    assert_relative(got[3], want[3], 2e-2, f"{dtype} grad hidden")
    assert_relative(got[4], want[4], 2e-2, f"{dtype} grad weight")


def run_fused_loss(backend, hidden, weight, targets, adv, temperature, chunk_tokens=None):
    """The fused policy loss op (a PPO-clip surrogate against log-probs 0.1 below, times a scale)."""
    from entr_megatron.parallel.fused_output_loss import vocab_parallel_linear_fused_loss

    x = hidden.cuda().requires_grad_()
    w = weight.cuda().requires_grad_()
    a = adv.cuda()

    def token_loss(s, e, lp, ent):
        ratio = torch.exp(lp - (lp.detach() - 0.1))
        return -torch.minimum(ratio * a[s:e], ratio.clamp(0.8, 1.2) * a[s:e]) / N

    loss, lp, ent = vocab_parallel_linear_fused_loss(x, w, targets.cuda(), token_loss, temperature=temperature,
                                                     vocab_size=REAL, chunk_tokens=chunk_tokens, backend=backend)
    (loss * 1.5).backward()
    return [t.detach().cpu() for t in (loss, lp, ent, x.grad, w.grad)]


@needs_triton
@pytest.mark.parametrize("chunk_tokens", [None, 128])
def test_triton_fused_loss_fp32_equals_the_torch_path(chunk_tokens):
    """The fused loss's Triton kernels (GEMM 1 with the statistics in its epilogue, the gradient
    written over the tile) against its PyTorch path on the same GPU, fp32: to 1e-5."""
    hidden, weight, targets, adv, _ = make_case(torch.float32, seed=2)
    got = run_fused_loss("triton", hidden, weight, targets, adv, 0.9, chunk_tokens)
    want = run_fused_loss("torch", hidden, weight, targets, adv, 0.9, chunk_tokens)
    for name, g, w in zip(("loss", "logprob", "entropy"), got[:3], want[:3]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=name)
    assert_relative(got[3], want[3], 1e-5, "grad hidden")
    assert_relative(got[4], want[4], 1e-5, "grad weight")
    assert not got[4][REAL:].any(), "padding rows get no gradient"


@needs_triton
def test_triton_fused_loss_bf16_is_close_to_the_torch_path():
    """bf16: both paths round the logits and their gradient to bf16; gradients to 2% of their largest entry."""
    hidden, weight, targets, adv, _ = make_case(torch.bfloat16, seed=3)
    got = run_fused_loss("triton", hidden, weight, targets, adv, 1.0)
    want = run_fused_loss("torch", hidden, weight, targets, adv, 1.0)
    torch.testing.assert_close(got[0], want[0], atol=2e-2 * max(want[0].abs().item(), 1e-3), rtol=0, msg="loss")
    assert_relative(got[3], want[3], 2e-2, "grad hidden")
    assert_relative(got[4], want[4], 2e-2, "grad weight")
