"""What the embedded engine's client (`embedded.py`) and its process (`embedded_worker.py`) say.

Both ends import this module and nothing of each other (the client only names the
worker's entry point, `run_worker`, as the target of the process it spawns):

    spawn:     run_worker(EmbeddedEngineConfig, commands, weights, events)
    commands   client -> decode loop      Submit | Abort | Pause | Resume | GetHealth | Shutdown
               receiver thread -> loop    Staged (a version is ready to swap in)
    weights    client -> receiver thread  RunReceiver, or BeginUpdate, Bucket..., EndUpdate
    events     process -> client          Ready | Results | Reply | CallFailed | Fatal

Pause, Resume, GetHealth and every weight update carry a call id; the process
answers each with one Reply (the value) or one CallFailed (the error). Every
message is one frozen record; the queues pickle them (weight buckets travel as
shared-memory tensors). A receiver reads a message through its channel's `decode`,
which raises `ProtocolError` naming the kind of anything the channel does not carry.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from entr_megatron.config.rollout import (
    KV_ON_UPDATE,
    QUANTIZE,
    QUANTIZE_SCALES,
    EmbeddedConfig,
    RolloutConfig,
    check_embedded_limits,
)
from entr_megatron.config.validate import integer
from entr_megatron.rollout.engine import EngineError, GenerateRequest, GenerateResult, WeightReceiver
from entr_megatron.rollout.hf_model import DTYPES, INITS
from entr_megatron.rollout.weights import TensorSpec, WeightBucket

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "COMMANDS",
    "EVENTS",
    "KV_ON_UPDATE",
    "WEIGHTS",
    "Abort",
    "BeginUpdate",
    "Bucket",
    "CancelUpdate",
    "CallFailed",
    "Channel",
    "EmbeddedEngineConfig",
    "EndUpdate",
    "Fatal",
    "GetHealth",
    "Pause",
    "ProtocolError",
    "Ready",
    "Reply",
    "Results",
    "Resume",
    "RunReceiver",
    "Shutdown",
    "Staged",
    "Submit",
]

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class EmbeddedEngineConfig:
    """Settings of one embedded engine (the engine process is spawned with it). The limits it
    shares with the run's `rollout.embedded` section (`EmbeddedConfig`) take that section's
    defaults and its validator (`check_embedded_limits`)."""

    SECTION = "EmbeddedEngineConfig"  # how a validation error names a field

    model_dir: str
    """Directory with the HF config.json (and, unless init="random", the checkpoint)."""
    dtype: str = "float32"
    """"float32" or "bfloat16": the engine's numerics (bf16 makes train-inference mismatch real)."""
    init: str = "auto"
    """"pretrained" (load the checkpoint), "random" (from the config, seeded by `seed`), "auto"
    (load if a checkpoint is there)."""
    seed: int = 0
    """Random init, and the seeds of requests that bring none."""
    attn_implementation: str = "sdpa"
    max_batch_size: int = EmbeddedConfig.max_batch_size
    """Samples decoded together; more wait."""
    max_model_len: int | None = None
    """Prompt + response limit (finish_reason "length"); default: the config's max_position_embeddings."""
    max_prefill_tokens: int = EmbeddedConfig.max_prefill_tokens
    """Padded prompt tokens admitted in one prefill (at least one request is always admitted)."""
    kv_on_update: str = "keep"
    """After a weight swap: "keep" the KV cache computed by the previous weights (in-flight update,
    no stall) or "recompute" it with the new weights (the swap then blocks for one prefill)."""
    num_threads: int | None = EmbeddedConfig.num_threads
    """torch intra-op threads of the engine process (None: torch's default)."""
    weight_bucket_bytes: int = 64 << 20
    """Bytes per shared-memory bucket when weights go through the engine's own queue."""
    weight_queue_depth: int = 2
    """Buckets in flight (bounds the sender's extra memory)."""
    initial_version: int = 0
    startup_timeout_s: float = 300.0
    rpc_timeout_s: float = 60.0
    update_timeout_s: float = 600.0
    record_routes: bool = False
    """Return each sample's MoE routes (`GenerateResult.routed_experts`); nothing for dense models."""
    quantize: str = "none"
    """"fp8": round the linear layers' weights to FP8 e4m3 at load and after every weight update
    (`rollout/quantize.py`); "none": compute in `dtype`."""
    quantize_scale: str = "per_channel"
    """FP8 scale granularity: "per_tensor", "per_channel" (output channel) or "block" (128 x 128)."""
    quantize_activations: bool = False
    """With quantize "fp8": also round each rounded linear layer's input (dynamic scale)."""
    device: str = EmbeddedConfig.device
    """Where the engine computes: "cpu", or "cuda" / "cuda:N" (weights, KV cache and sampling on
    that GPU; in a `train` run its weights arrive through `weight_sync.colocated`)."""
    free_cache_engine: bool = EmbeddedConfig.free_cache_engine
    """On a GPU: empty torch's CUDA cache whenever nothing is left to decode (rollout.embedded)."""

    @classmethod
    def from_config(cls, rollout: RolloutConfig, *, model_dir: str, max_model_len: int | None, seed: int,
                    **overrides: Any) -> EmbeddedEngineConfig:
        """One engine of the run's validated `rollout` section (its dtype, kv_on_update and
        `rollout.embedded`), serving the checkpoint in `model_dir`."""
        e = rollout.embedded
        fields = dict(model_dir=str(model_dir), dtype=rollout.dtype, init="pretrained", seed=seed,
                      max_batch_size=e.max_batch_size, max_prefill_tokens=e.max_prefill_tokens,
                      max_model_len=max_model_len, kv_on_update=rollout.kv_on_update or "keep",
                      num_threads=e.num_threads, record_routes=rollout.record_routes,
                      quantize=rollout.quantize, quantize_scale=rollout.quantize_scale,
                      quantize_activations=rollout.quantize_activations, free_cache_engine=e.free_cache_engine)
        return cls(**{**fields, **overrides})

    def __post_init__(self):
        def one_of(name: str, allowed: tuple) -> None:
            if getattr(self, name) not in allowed:
                raise ValueError(f"EmbeddedEngineConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")

        one_of("dtype", tuple(DTYPES))
        one_of("init", INITS)
        one_of("kv_on_update", KV_ON_UPDATE)
        one_of("attn_implementation", ATTN_IMPLEMENTATIONS)
        one_of("quantize", QUANTIZE)
        one_of("quantize_scale", QUANTIZE_SCALES)
        if self.quantize_activations and self.quantize == "none":
            raise ValueError("EmbeddedEngineConfig.quantize_activations needs quantize 'fp8', got quantize 'none'")
        check_embedded_limits(self)
        if not _DEVICE.fullmatch(str(self.device)):
            raise ValueError(f"EmbeddedEngineConfig.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        for name in ("weight_bucket_bytes", "weight_queue_depth"):
            integer(self, name, low=1)
        integer(self, "max_model_len", low=1, optional=True)


class ProtocolError(EngineError):
    """A message of a kind its channel does not carry (a bug, or two code versions talking)."""


# --- commands: to the decode loop, handled between two decode steps ------------------------


@dataclass(frozen=True)
class Submit:
    """Queue these requests (their request ids set) for decoding."""

    requests: tuple[GenerateRequest, ...]


@dataclass(frozen=True)
class Abort:
    """End these requests; their samples come back as Results with finish_reason "abort"."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class CancelUpdate:
    """Give up the weight version being received (`WeightReceiver.cancel`): the update in
    progress fails with CallFailed, the engine keeps the weights it holds. Not answered."""


@dataclass(frozen=True)
class Pause:
    """Stop decoding; answered (Reply None) between two steps."""

    call_id: int


@dataclass(frozen=True)
class Resume:
    """Decode again; answered with Reply None."""

    call_id: int


@dataclass(frozen=True)
class GetHealth:
    """Answered with Reply(EngineHealth)."""

    call_id: int


@dataclass(frozen=True)
class Staged:
    """From the receiver thread: update `call_id` is staged; swap it in and answer it."""

    call_id: int
    t_call: float
    """When the client was called (time.time()), for the report's timings."""
    steps_at_begin: int
    """Decode steps done when the transfer began."""


@dataclass(frozen=True)
class Shutdown:
    """Leave the decode loop now (the messages after it are dropped)."""


# --- weights: to the receiver thread, one update at a time ---------------------------------


@dataclass(frozen=True)
class RunReceiver:
    """Update `call_id` to `version` by running `receiver` in the engine process."""

    call_id: int
    version: int
    t_call: float
    receiver: WeightReceiver


@dataclass(frozen=True)
class BeginUpdate:
    """Update `call_id` to `version` from the Buckets that follow, up to its EndUpdate."""

    call_id: int
    version: int
    t_call: float


@dataclass(frozen=True)
class Bucket:
    """Tensors of update `call_id` (shared-memory buffer)."""

    call_id: int
    bucket: WeightBucket


@dataclass(frozen=True)
class EndUpdate:
    """The last message of update `call_id`."""

    call_id: int
    sender_error: str | None
    """repr of the exception that stopped the client mid-update (the update then fails)."""


# --- events: from the engine process to the client -----------------------------------------


@dataclass(frozen=True)
class Ready:
    """The model is loaded and the decode loop runs."""

    specs: dict[str, TensorSpec]
    """Names (model.state_dict(), tied ones included), shapes and dtypes the engine holds."""
    version: int
    vocab_size: int
    max_model_len: int | None
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Results:
    """Finished (or aborted) samples."""

    results: tuple[GenerateResult, ...]


@dataclass(frozen=True)
class Reply:
    """Call `call_id` succeeded: its value (None, EngineHealth or WeightUpdateReport)."""

    call_id: int
    value: Any


@dataclass(frozen=True)
class CallFailed:
    """Call `call_id` failed: a plain message for a rejected request (a ValueError in the
    engine: the client raises ValueError), else the engine's traceback."""

    call_id: int
    error: str


@dataclass(frozen=True)
class Fatal:
    """The engine process is dying (its traceback)."""

    error: str


# --- channels --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Channel:
    """One queue's name and the message kinds it carries."""

    name: str
    kinds: tuple[type, ...]

    def decode(self, msg: object) -> Any:
        """`msg` itself if this channel carries its kind; else ProtocolError naming the kind."""
        if type(msg) not in self.kinds:
            raise ProtocolError(
                f"embedded engine {self.name} queue: unknown message kind {type(msg).__qualname__!r} "
                f"({msg!r:.200}); it carries {', '.join(k.__name__ for k in self.kinds)}"
            )
        return msg

    def dispatcher(self, handlers: Mapping[type, Callable[[Any], Any]]) -> Callable[[object], Any]:
        """A function that decodes a message and calls the handler of its kind (one per kind)."""
        if set(handlers) != set(self.kinds):
            raise ValueError(
                f"{self.name} handlers cover {sorted(k.__name__ for k in handlers)}, "
                f"the channel carries {sorted(k.__name__ for k in self.kinds)}"
            )
        table = dict(handlers)
        return lambda msg: table[type(self.decode(msg))](msg)


COMMANDS = Channel("command", (Submit, Abort, CancelUpdate, Pause, Resume, GetHealth, Staged, Shutdown))
WEIGHTS = Channel("weight", (RunReceiver, BeginUpdate, Bucket, EndUpdate))
EVENTS = Channel("event", (Ready, Results, Reply, CallFailed, Fatal))
