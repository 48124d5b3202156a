"""Run megatron-core on a CPU build of torch (gloo): every CUDA call site, redirected here.

megatron-core hard-codes CUDA in code paths that have nothing GPU-specific about
them. ``enable_cpu_compat()`` redirects exactly those call sites and nothing else;
it is idempotent and a no-op when ``torch.cuda.is_available()``, so the same
learner code runs on GPU clusters untouched. Measurements and the probing behind
this list: ``docs/MEGATRON_ON_CPU.md``.

Redirected call sites (megatron-core 0.16.1; 0.17.0 has the same ones):

1. ``torch`` seen by these modules is a proxy (``cpu_torch.CpuTorch``): ``torch.cuda``
   has a CPU ``current_device()``, no-op ``synchronize()``, null ``Stream``/
   ``Event``/``stream()``, and tensor factories map ``device="cuda"`` to CPU.
   Everything else is the real ``torch``; other modules never see the proxy.

   ====================================================  =========================================
   module (``megatron.core.`` omitted)                    call site
   ====================================================  =========================================
   pipeline_parallel.schedules                           ``total_num_tokens = torch.zeros(..., device="cuda")``
   pipeline_parallel.p2p_communication                   receive buffers on ``current_device()``; ``synchronize()`` after batched p2p
   distributed.param_and_grad_buffer                     grad buffers on ``current_device()``
   distributed.distributed_data_parallel                 communication ``Stream``, ``synchronize()``
   tensor_parallel.mappings                              gather/scatter/SP buffers on ``current_device()``
   tensor_parallel.layers                                SP all-gather buffer, GPU-init weights on ``current_device()``
   tensor_parallel.utils                                 ``gather_split_1d_tensor`` buffer
   transformer.utils                                     ``get_default_causal_mask`` (used by fused_softmax) on "cuda"
   models.common.embeddings.rotary_pos_embedding         RoPE ``inv_freq`` moved to ``current_device()``
   models.common.embeddings.yarn_rotary_pos_embedding    YaRN (MLA) ``inv_freq_*`` built on and moved to ``current_device()``
   transformer.moe.router                                router weight moved to ``current_device()``
   transformer.moe.experts                               expert weights (GPU init) on ``current_device()``
   transformer.moe.token_dispatcher                      alltoall dispatcher's D2H ``torch.cuda.Stream()``
   transformer.moe.shared_experts                        overlap ``Stream``
   transformer.moe.moe_utils                             aux-loss tracker on "cuda"
   optimizer.optimizer                                   ``found_inf``/scale tensors on "cuda"
   optimizer.clip_grads                                  norm/overflow buffers on "cuda"
   optimizer.distrib_optimizer                           gather buffers on ``current_device()``
   utils                                                 global memory buffer, ``local_multi_tensor_l2_norm`` on "cuda"
   dist_checkpointing.strategies.filesystem_async        ``torch.cuda.synchronize()`` in save
   dist_checkpointing.strategies.state_dict_saver        save's failure flag broadcast on ``current_device()``
   dist_checkpointing.strategies.async_utils             async-save liveness flags on ``current_device()``, ``synchronize()``
   ====================================================  =========================================

2. Tensor methods, only while one of these functions runs (``_cpu_tensor_methods``):
   ``Tensor.cuda()`` returns the CPU tensor and ``Tensor.type()`` reports
   ``torch.cuda.*Tensor`` for CPU tensors, because these compare type strings:
   ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings with PP>1:
   ``weight.data.cuda()``), ``clip_grads.clip_grad_by_total_norm_fp32``,
   ``DistributedOptimizer._build_model_and_main_param_groups`` and
   ``Float16OptimizerWithFloat16Params.__init__`` (``== 'torch.cuda.FloatTensor'``).
3. RNG (``tensor_parallel.random``): the CPU default generator stands in for the
   CUDA one: ``CudaRNGStatesTracker`` -> ``_CpuRNGStatesTracker``,
   ``_get/_set_cuda_rng_state`` -> ``torch.get/set_rng_state``, and
   ``torch.cuda.manual_seed`` -> ``torch.manual_seed`` inside that module.
4. MoE: ``moe_utils.te_general_gemm`` is defined as ``None`` without
   TransformerEngine (0.16.1 raises NameError; fixed in 0.17), and the alltoall
   dispatcher's ``maybe_move_tensor_to_cpu`` also turns CPU split sizes into numpy
   (upstream converts only CUDA tensors).

5. MLA: without TransformerEngine, megatron's ``transformer_engine`` extension defines
   ``TELinear`` as a ``MagicMock``, yet ``multi_latent_attention.HAVE_TE`` is True (the import
   of the extension succeeds), so ``MultiLatentAttention.__init__`` calls
   ``isinstance(linear_proj, TELinear)`` and raises TypeError: ``HAVE_TE`` is set False there.

Traps that no patch can fix (``check_cpu_config`` enforces them):

* Interleaved PP with ``batch_p2p_comm=True`` gives silently WRONG losses on gloo
  (previous and next peer are the same rank; gloo matches batched isend/irecv in
  posting order). ``check_cpu_config`` sets ``batch_p2p_comm=False`` on CPU.
* Sequence parallelism: megatron's local ``WrappedTorchNorm`` asserts; use the
  portable spec's norms (``learner.spec``), whose weights are marked
  ``sequence_parallel`` so their grads are all-reduced over TP.
* MoE with TP>1 requires sequence parallelism.
* The alltoall dispatcher with expert-TP>1 fails on gloo (no uneven all_gather):
  use ``expert_tensor_parallel_size=1`` or the allgather dispatcher on CPU.
* ``add_bias_linear=True`` breaks ``SequentialMLP`` at TP=1 (in-place view error).
* dist_checkpointing save needs ``psutil``; unless its results queue is set first (as
  ``checkpoint.io`` does) it starts a spawn Manager, and the launching script then needs
  an ``if __name__ == "__main__"`` guard.
* Fully-parallel checkpoint load hard-codes ``.cuda()`` (not redirected here).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import types
import warnings

import torch

from entr_megatron.parallel.cpu_torch import CpuTorch

__all__ = [
    "VERIFIED_MEGATRON_CORE_VERSIONS",
    "UNVERIFIED_ENV_VAR",
    "check_megatron_version",
    "check_cpu_config",
    "cpu_compat_enabled",
    "enable_cpu_compat",
]

logger = logging.getLogger(__name__)

# The call sites below were found and every redirect verified against these
# releases only; a different release may move or add call sites.
VERIFIED_MEGATRON_CORE_VERSIONS = ("0.16.1",)
# Set to 1 to run on an unverified megatron-core anyway (a warning is issued).
UNVERIFIED_ENV_VAR = "ENTR_MEGATRON_UNVERIFIED_MEGATRON"

_PROXIED_MODULES = (
    "pipeline_parallel.schedules",
    "pipeline_parallel.p2p_communication",
    "distributed.param_and_grad_buffer",
    "distributed.distributed_data_parallel",
    "tensor_parallel.mappings",
    "tensor_parallel.layers",
    "tensor_parallel.utils",
    "transformer.utils",
    "models.common.embeddings.rotary_pos_embedding",
    "models.common.embeddings.yarn_rotary_pos_embedding",
    "transformer.moe.router",
    "transformer.moe.experts",
    "transformer.moe.token_dispatcher",
    "transformer.moe.shared_experts",
    "transformer.moe.moe_utils",
    "optimizer.optimizer",
    "optimizer.clip_grads",
    "optimizer.distrib_optimizer",
    "utils",
    "dist_checkpointing.strategies.filesystem_async",
    "dist_checkpointing.strategies.state_dict_saver",
    "dist_checkpointing.strategies.async_utils",
)

_enabled = False


def _megatron(name: str) -> types.ModuleType:
    return importlib.import_module(f"megatron.core.{name}")


# --- 2. tensor methods while a few functions run -----------------------------------

_real_tensor_type = torch.Tensor.type
_real_tensor_cuda = torch.Tensor.cuda


def _type_as_if_cuda(self, dtype=None, non_blocking=False, **kwargs):
    name = _real_tensor_type(self, dtype, non_blocking, **kwargs)
    if dtype is None and self.device.type == "cpu":
        return name.replace("torch.", "torch.cuda.", 1)
    return name


def _cuda_stays_on_cpu(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


@contextlib.contextmanager
def _cpu_tensor_methods():
    """While active (process-wide): ``.type()`` answers as if on CUDA, ``.cuda()`` is the identity."""
    torch.Tensor.type, torch.Tensor.cuda = _type_as_if_cuda, _cuda_stays_on_cpu
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = _real_tensor_type, _real_tensor_cuda


def _with_cpu_tensor_methods(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cpu_tensor_methods():
            return fn(*args, **kwargs)

    return wrapper


def _wrap_method(cls, name):
    raw = cls.__dict__[name]
    if isinstance(raw, classmethod):
        setattr(cls, name, classmethod(_with_cpu_tensor_methods(raw.__func__)))
    elif isinstance(raw, staticmethod):
        setattr(cls, name, staticmethod(_with_cpu_tensor_methods(raw.__func__)))
    else:
        setattr(cls, name, _with_cpu_tensor_methods(raw))


# --- 3. RNG --------------------------------------------------------------------------

def _get_cpu_rng_state(device=None, clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _make_cpu_tracker_class(random_mod):
    base = random_mod.CudaRNGStatesTracker

    class _CpuRNGStatesTracker(base):
        """Megatron's RNG tracker with the CPU default generator in place of the CUDA one.

        ``add`` and ``fork`` are re-stated because the originals call
        ``torch.cuda.get_rng_state`` directly and, on CPU, would warn on every fork
        that "the CPU RNG state changed" (it is the forked state here).
        """

        # Read by parallel.groups (a lower layer, which cannot import this module).
        runs_on_cpu = True

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=random_mod._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state, orig_name = torch.get_rng_state(), self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return _CpuRNGStatesTracker


def _patch_rng():
    random_mod = _megatron("tensor_parallel.random")
    random_mod.CudaRNGStatesTracker = _make_cpu_tracker_class(random_mod)
    random_mod._get_cuda_rng_state = _get_cpu_rng_state
    random_mod._set_cuda_rng_state = _set_cpu_rng_state
    random_mod.torch = CpuTorch()  # torch.cuda.manual_seed in model_parallel_cuda_manual_seed
    # A tracker created before enabling would still be the CUDA one.
    random_mod._CUDA_RNG_STATE_TRACKER = None
    random_mod._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


# --- 4. MoE ----------------------------------------------------------------------------

def _patch_moe():
    moe_utils = _megatron("transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    dispatcher = _megatron("transformer.moe.token_dispatcher")
    upstream = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(upstream)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        out = upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(out):
            return out.numpy()  # upstream converts only CUDA tensors
        return out

    dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# --- 5. MLA ------------------------------------------------------------------------------

def _patch_mla():
    if importlib.util.find_spec("transformer_engine") is None:
        _megatron("transformer.multi_latent_attention").HAVE_TE = False


# --- public API --------------------------------------------------------------------------

def check_megatron_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` unless megatron-core ``version`` (default: installed) was verified.

    With ``ENTR_MEGATRON_UNVERIFIED_MEGATRON=1`` an unverified version only warns.
    """
    if version is None:
        from megatron.core import package_info

        version = package_info.__version__
    if version in VERIFIED_MEGATRON_CORE_VERSIONS:
        return
    message = (
        f"entr_megatron's CPU compatibility layer was verified with megatron-core "
        f"{', '.join(VERIFIED_MEGATRON_CORE_VERSIONS)}, but {version} is installed; its CUDA call "
        f"sites may have moved. Install a verified version, or set {UNVERIFIED_ENV_VAR}=1 to try anyway."
    )
    if os.environ.get(UNVERIFIED_ENV_VAR) == "1":
        warnings.warn(message + f" ({UNVERIFIED_ENV_VAR}=1 is set: continuing)", RuntimeWarning, stacklevel=2)
        return
    raise RuntimeError(message)


def cpu_compat_enabled() -> bool:
    """Whether ``enable_cpu_compat`` has patched megatron-core in this process."""
    return _enabled


def enable_cpu_compat() -> bool:
    """Redirect megatron-core's CUDA call sites to CPU; returns whether the patches are active.

    Idempotent. A no-op returning ``False`` when CUDA is available. Raises
    ``RuntimeError`` on an unverified megatron-core (see ``check_megatron_version``).
    """
    global _enabled
    if torch.cuda.is_available():
        return False
    if _enabled:
        return True
    check_megatron_version()
    proxy = CpuTorch()
    for name in _PROXIED_MODULES:
        _megatron(name).torch = proxy
    language_module = _megatron("models.common.language_module.language_module")
    _wrap_method(language_module.LanguageModule, "setup_embeddings_and_output_layer")
    clip_grads = _megatron("optimizer.clip_grads")
    optimizer = _megatron("optimizer.optimizer")
    clip_fn = _with_cpu_tensor_methods(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip_fn
    optimizer.clip_grad_by_total_norm_fp32 = clip_fn  # imported by name there
    _wrap_method(optimizer.Float16OptimizerWithFloat16Params, "__init__")
    distrib = _megatron("optimizer.distrib_optimizer")
    _wrap_method(distrib.DistributedOptimizer, "_build_model_and_main_param_groups")
    _patch_rng()
    _patch_moe()
    _patch_mla()
    _enabled = True
    logger.info("megatron-core CUDA call sites redirected to CPU")
    return True


def check_cpu_config(config) -> None:
    """Adjust or refuse a megatron ``TransformerConfig`` for the traps of a CPU run (module docstring).

    Sets ``batch_p2p_comm=False`` (batched p2p on gloo silently corrupts
    interleaved PP and gains nothing on CPU); raises ``ValueError`` naming the
    field for layouts known to fail. A no-op when CUDA is available.
    """
    if torch.cuda.is_available():
        return
    if config.batch_p2p_comm and config.pipeline_model_parallel_size > 1:
        logger.info("batch_p2p_comm=True is unsafe on gloo (wrong losses with interleaved PP): using False")
    config.batch_p2p_comm = False
    if config.num_moe_experts:
        if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
            raise ValueError(
                "sequence_parallel must be True for MoE with tensor_model_parallel_size > 1 "
                f"(got tensor_model_parallel_size={config.tensor_model_parallel_size})"
            )
        etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
        if etp > 1 and config.moe_token_dispatcher_type == "alltoall":
            raise ValueError(
                f"moe_token_dispatcher_type='alltoall' with expert_tensor_parallel_size={etp} fails on "
                "gloo (no uneven all_gather): use expert_tensor_parallel_size=1 or "
                "moe_token_dispatcher_type='allgather' on CPU"
            )
        if config.add_bias_linear and not config.moe_grouped_gemm and etp == 1:
            raise ValueError(
                "add_bias_linear=True breaks megatron's SequentialMLP experts at expert tensor parallel "
                "size 1 (in-place view error): use add_bias_linear=False for MoE models"
            )
