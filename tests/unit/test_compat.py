"""The CPU compatibility layer for megatron-core: version guard, idempotence, scoping, RNG, config traps."""

import pytest
import torch

from entr_megatron.parallel import cpu_compat as compat

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the compat layer is a no-op with CUDA")


def test_unverified_version_is_refused_with_the_way_out(monkeypatch):
    monkeypatch.delenv(compat.UNVERIFIED_ENV_VAR, raising=False)
    with pytest.raises(RuntimeError) as e:
        compat.check_megatron_version("0.15.0")
    msg = str(e.value)
    assert "0.15.0" in msg and "0.16.1" in msg and f"{compat.UNVERIFIED_ENV_VAR}=1" in msg


def test_override_turns_the_refusal_into_a_warning(monkeypatch):
    monkeypatch.setenv(compat.UNVERIFIED_ENV_VAR, "1")
    with pytest.warns(RuntimeWarning, match="0.17.0"):
        compat.check_megatron_version("0.17.0")


def test_installed_version_is_verified():
    from megatron.core import package_info

    assert package_info.__version__ in compat.VERIFIED_MEGATRON_CORE_VERSIONS
    compat.check_megatron_version()


def _patched_objects():
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mp_random

    return (schedules.torch, mp_random.CudaRNGStatesTracker, mp_random._set_cuda_rng_state,
            LanguageModule.__dict__["setup_embeddings_and_output_layer"], clip_grads.clip_grad_by_total_norm_fp32)


@cpu_only
def test_enabling_twice_is_harmless():
    assert compat.enable_cpu_compat() is True
    first = _patched_objects()
    assert compat.enable_cpu_compat() is True and compat.cpu_compat_enabled()
    assert _patched_objects() == first  # nothing wrapped twice


@cpu_only
def test_redirects_are_scoped_to_megatron_call_sites():
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import attention

    compat.enable_cpu_compat()
    proxied = schedules.torch
    assert proxied is not torch and proxied.cuda.current_device() == torch.device("cpu")
    assert proxied.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    proxied.cuda.synchronize()
    with proxied.cuda.stream(proxied.cuda.Stream()):
        pass
    assert proxied.Tensor is torch.Tensor and proxied.distributed is torch.distributed
    # The real torch and modules without CUDA call sites are untouched.
    assert attention.torch is torch
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


@cpu_only
def test_tensor_type_reports_cuda_only_inside_patched_functions():
    compat.enable_cpu_compat()
    x = torch.zeros(2)
    with compat._cpu_tensor_methods():
        assert x.type() == "torch.cuda.FloatTensor" and x.cuda() is x
        assert x.type(torch.float64).dtype == torch.float64
    assert x.type() == "torch.FloatTensor"
    with pytest.raises(KeyError), compat._cpu_tensor_methods():
        raise KeyError
    assert x.type() == "torch.FloatTensor"  # restored after an exception too


@cpu_only
def test_rng_tracker_uses_the_cpu_generator():
    from megatron.core.tensor_parallel import random as mp_random

    compat.enable_cpu_compat()
    mp_random.model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    tracker = mp_random.get_cuda_rng_tracker()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is restored
    with tracker.fork():
        b = torch.rand(4)  # the tracked stream continues, it does not restart
    assert not torch.equal(a, b)
    mp_random.model_parallel_cuda_manual_seed(11, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    with mp_random.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(4), a)  # same seed, same stream


@cpu_only
def test_interleaved_pipeline_gets_unbatched_p2p():
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, pipeline_model_parallel_size=2,
                            virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    assert cfg.batch_p2p_comm
    compat.check_cpu_config(cfg)
    assert not cfg.batch_p2p_comm


def _moe_config(**fields):
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                            moe_router_topk=2, add_bias_linear=False)
    for k, v in fields.items():  # set after construction: megatron's own checks are not under test
        setattr(cfg, k, v)
    return cfg


@cpu_only
@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(tensor_model_parallel_size=2, sequence_parallel=False), "sequence_parallel must be True"),
        (dict(expert_tensor_parallel_size=2, moe_token_dispatcher_type="alltoall"), "expert_tensor_parallel_size=2"),
        (dict(add_bias_linear=True), "add_bias_linear"),
    ],
)
def test_moe_layouts_that_fail_on_gloo_are_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        compat.check_cpu_config(_moe_config(**fields))


@cpu_only
def test_supported_moe_layout_passes():
    compat.check_cpu_config(_moe_config(moe_token_dispatcher_type="allgather", expert_tensor_parallel_size=2,
                                        tensor_model_parallel_size=2, sequence_parallel=True))
