"""The `rollout` section: inference engines and sampling. Layer L0.

The fields mirror the user-facing ones of the engines (`rollout/embedded.py`,
`rollout/sglang_*.py`, `rollout/engine.SamplingParams`); the controller translates them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

from entr_megatron.config.model import MAX_SEQ_LEN
from entr_megatron.config.validate import bad, boolean, choice, integer, number, str_tuple, string, url_tuple

Engine = Literal["embedded", "sglang"]
ENGINES: tuple[str, ...] = get_args(Engine)
EmbeddedDtype = Literal["float32", "bfloat16"]
EMBEDDED_DTYPES: tuple[str, ...] = get_args(EmbeddedDtype)
SGLangDtype = Literal["auto", "bfloat16", "float16", "float32"]
SGLANG_DTYPES: tuple[str, ...] = get_args(SGLangDtype)
WeightSnapshot = Literal["borrow", "copy"]
WEIGHT_SNAPSHOTS: tuple[str, ...] = get_args(WeightSnapshot)
Placement = Literal["separate", "colocated"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
EmbeddedDevice = Literal["cpu", "cuda"]
EMBEDDED_DEVICES: tuple[str, ...] = get_args(EmbeddedDevice)
KvOnUpdate = Literal["keep", "recompute"]
KV_ON_UPDATE: tuple[str, ...] = get_args(KvOnUpdate)
Quantize = Literal["none", "fp8"]
QUANTIZE: tuple[str, ...] = get_args(Quantize)
QuantizeScale = Literal["per_tensor", "per_channel", "block"]
QUANTIZE_SCALES: tuple[str, ...] = get_args(QuantizeScale)
RouterPolicy = Literal["cache_aware", "round_robin", "random"]
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicy)
ENV_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""What `rollout.sglang.api_key_env` may hold: the name of an environment variable."""
CPU_MAX_TOTAL_TOKENS = 65536
"""rollout.sglang.max_total_tokens of a server launched on CPU when unset (SGLang's own sizing
allocated 58 M tokens, about 20 GB of RAM, for the CPU demo's 0.8 M-parameter model)."""
MAX_PROMPTS_PER_STEP = 65_536
"""Upper bound of rollout.prompts_per_step (and the planner's workload.prompts_per_step)."""
MAX_SAMPLES_PER_PROMPT = 1024
"""Upper bound of rollout.sampling.n (and the planner's workload.n)."""
MAX_NEW_TOKENS = MAX_SEQ_LEN
"""Upper bound of rollout.sampling.max_new_tokens: model.max_seq_len's (and of the planner's token counts)."""
MAX_ENGINES = 4096
"""Upper bound of rollout.num_engines (and the planner's costs.engines)."""
DEFAULT_WEIGHT_BUCKET_MIB = 512
"""rollout.weight_bucket_mib when unset: the one default of a weight-sync bucket's size (the
learner's sender, the SGLang engine, `WeightSyncConfig`; read as `RolloutConfig.weight_bucket_bytes`)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled (mirrors rollout.engine.SamplingParams)."""

    SECTION = "rollout.sampling"

    temperature: float = 1.0
    """Logits are divided by it. > 0 (RL needs a stochastic policy). The learner takes its
    log-probs and entropy of the same softmax(z / T)."""

    top_p: float = 1.0
    """Nucleus truncation; 1.0 keeps every token. In (0, 1]."""

    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0: no top-k. >= -1."""

    max_new_tokens: int = 128
    """Response length limit in tokens. In [1, MAX_NEW_TOKENS]."""

    n: int = 8
    """Samples per prompt: the GRPO group size. In [2, MAX_SAMPLES_PER_PROMPT] (group advantages
    need a baseline)."""

    def __post_init__(self) -> None:
        number(self, "temperature", low=0, low_open=True)
        number(self, "top_p", low=0, high=1, low_open=True)
        integer(self, "top_k", low=-1)
        integer(self, "max_new_tokens", low=1, high=MAX_NEW_TOKENS)
        integer(self, "n", low=2, high=MAX_SAMPLES_PER_PROMPT)


@dataclass(frozen=True)
class SGLangConfig:
    """SGLang servers (`python -m sglang.launch_server`), started by `train` on the GPUs after the
    learner's, or on this node's CPU with launcher.device 'cpu' (docs/SGLANG_ON_CPU.md), or given by urls."""

    SECTION = "rollout.sglang"

    tp_size: int = 1
    """GPUs (tensor-parallel ranks) per server. >= 1."""

    mem_fraction_static: float | None = None
    """Fraction of GPU memory for weights + KV cache. None: SGLang's default. In (0, 1)."""

    base_port: int = 30000
    """Port of the first server on a node; server i uses base_port + i. In [1024, 65535]."""

    extra_args: tuple[str, ...] = ()
    """Passed to launch_server unchanged, e.g. ["--disable-radix-cache"]."""

    router: bool = False
    """Put sglang-router in front of the servers (one URL, cache-aware load balancing)."""

    router_policy: RouterPolicy = "cache_aware"
    """Router load-balancing policy: one of ROUTER_POLICIES."""

    max_concurrent_requests: int = 256
    """Requests in flight per server from the controller. >= 1."""

    startup_timeout_s: float = 1800.0
    """Seconds to wait for a server to load its model. Positive, finite."""

    host: str = "127.0.0.1"
    """Address the launched servers and the router listen on (SGLang --host). The default,
    loopback, is reachable from this node only: the servers have no other access control than
    api_key_env. "0.0.0.0": every interface. Does not apply to servers given by urls."""

    api_key_env: str | None = None
    """Name of the environment variable holding the servers' API key (e.g. SGLANG_API_KEY), never
    the key itself. Launched servers and the router get it as --api-key (read from the
    environment inside the process, so it is in no command line, log or file); every request
    sends it as `Authorization: Bearer <key>`. The variable must be set wherever an engine client
    is built: the controller and learner rank 0. None: no key."""

    request_timeout_s: float = 60.0
    """Seconds one control call may take (health, model info, abort, pause, resume, flush).
    Positive, finite."""

    generate_timeout_s: float = 3600.0
    """Seconds one /generate call (a prompt's n samples, not streamed) may take. Positive, finite."""

    weight_update_timeout_s: float = 1800.0
    """Seconds for joining the weight-update group and for each bucket of an update. Positive, finite."""

    http_retries: int = 3
    """Retries of an idempotent call (GET /health, /model_info, /server_info, POST /flush_cache)
    after no connection, no answer in time, a cut-off answer or HTTP 502/503/504. /generate and
    the weight-update calls are sent once. >= 0."""

    retry_backoff_s: float = 0.5
    """Wait before the first retry, doubled for each next one (at most 30 s). Positive, finite."""

    probe_interval_s: float = 5.0
    """A server given by `urls` that failed is set aside and its /health asked again after this
    many seconds, then after twice as long each time (at most 60 s); it is taken back, with the
    learner's weights, once it answers. Positive, finite."""

    server_wait_s: float = 600.0
    """Seconds the run waits for a server given by `urls` to answer again when none is left in
    service; past it the run stops, naming each server and its error. Positive, finite."""

    python: str | None = None
    """Interpreter of the launched servers (`<python> -m sglang.launch_server`), e.g.
    .venv-sglang/bin/python, the venv scripts/setup_sglang_cpu.sh makes (SGLang pins a torch of its
    own, so it lives in a venv of its own). Relative paths are taken from the working directory.
    None: this process's interpreter. Does not apply to servers given by urls."""

    max_total_tokens: int | None = None
    """KV-cache tokens of a launched server (--max-total-tokens). None: sized by SGLang from
    mem_fraction_static on GPU; on CPU (launcher.device 'cpu') CPU_MAX_TOTAL_TOKENS, since SGLang's
    own sizing there takes most of the machine's RAM. >= 64."""

    urls: tuple[str, ...] | None = None
    """Already running servers (http:// or https://host:port), one per engine (rollout.num_engines
    of them): `train` launches nothing and drives these, and tp_size, mem_fraction_static,
    base_port, extra_args, host and startup_timeout_s do not apply (the servers' own flags do;
    with api_key_env, start them with --api-key set to the same key; recording MoE routes,
    rollout.record_routes or algorithm.routing_replay 'r3', with --enable-return-routed-experts,
    else every answer is refused for its missing routes). The servers must reach
    learner rank 0, which hosts the weight-update group and listens on that address only
    (launcher.master_addr; with Ray, rank 0's node IP);
    their weights are overwritten by the learner's before the first rollout. Any launcher.device
    works (the servers run elsewhere). None: `train` launches rollout.num_engines servers on its
    own node (launcher.kind 'local', one node, no engine_nodes), on the GPUs after the learner's."""

    def __post_init__(self) -> None:
        if self.urls is not None:
            url_tuple(self, "urls")
        integer(self, "tp_size", low=1)
        if self.mem_fraction_static is not None:
            number(self, "mem_fraction_static", low=0, high=0.99, low_open=True)
        integer(self, "base_port", low=1024, high=65535)
        str_tuple(self, "extra_args")
        boolean(self, "router")
        choice(self, "router_policy", RouterPolicy)
        integer(self, "max_concurrent_requests", low=1)
        string(self, "host")
        string(self, "api_key_env", optional=True)
        if self.api_key_env is not None and not ENV_VAR_NAME.fullmatch(self.api_key_env):
            # Not echoed: a value that is no variable name may be the key itself.
            raise bad(self, "api_key_env", "<not shown>",
                      "must be null or the name of an environment variable ([A-Za-z_][A-Za-z0-9_]*) that holds the key, "
                      "not the key")
        for name in ("startup_timeout_s", "request_timeout_s", "generate_timeout_s", "weight_update_timeout_s",
                     "retry_backoff_s", "probe_interval_s", "server_wait_s"):
            number(self, name, low=0, high=math.inf, low_open=True, high_open=True)
        integer(self, "http_retries", low=0)
        string(self, "python", optional=True)
        integer(self, "max_total_tokens", low=64, optional=True)


@dataclass(frozen=True)
class EmbeddedConfig:
    """The embedded engine (HF transformers, CPU or one GPU), each in its own process."""

    SECTION = "rollout.embedded"

    max_batch_size: int = 32
    """Samples decoded together; more wait. >= 1."""

    max_prefill_tokens: int = 8192
    """Padded prompt tokens admitted in one prefill. >= 1."""

    num_threads: int | None = None
    """torch intra-op threads of each engine process. None, on one CPU machine: the cores where the
    work is (as launcher.cpu_threads_per_rank); elsewhere torch's default. >= 1."""

    device: EmbeddedDevice = "cpu"
    """Where each engine process computes (one of EMBEDDED_DEVICES). 'cuda': engine i on GPU
    i mod launcher.gpus_per_node, beside the learner ranks (needs rollout.placement 'colocated',
    launcher.device 'cuda' and launcher.kind 'local'): the learner copies each weight bucket
    device-to-device into the engine's staging copy through a CUDA IPC handle."""

    free_cache_engine: bool = True
    """With device 'cuda': whenever the engine has nothing to decode, hand the memory its KV cache
    and activations held back to the GPU (torch.cuda.empty_cache()), so that the learner's step can
    use it; the next batch allocates afresh (verl's rollout.free_cache_engine, the KV half of
    slime's and verl's sleep/wake; the weights stay on the GPU). No effect on the CPU."""

    health_timeout_s: float = 60.0
    """Seconds an engine has to answer a health check (asked when it failed a call, or when no
    sample came for rollout.poll_timeout_s); one that does not is killed (SIGKILL) and replaced
    like a dead one (rollout.max_engine_restarts). With launcher.kind 'ray' also what an engine
    actor has to answer any other call of the controller's (submit, abort, a poll beyond its own
    wait). Positive, finite."""

    def __post_init__(self) -> None:
        check_embedded_limits(self)
        choice(self, "device", EmbeddedDevice)
        boolean(self, "free_cache_engine")
        number(self, "health_timeout_s", low=0, high=math.inf, low_open=True, high_open=True)


def check_embedded_limits(section) -> None:
    """The limits `EmbeddedConfig` shares with the engine's own `EmbeddedEngineConfig`
    (rollout/embedded_protocol.py), checked by this one validator for both: batch size,
    prefill tokens (>= 1) and threads (None or >= 1). Errors name `section`'s SECTION."""
    integer(section, "max_batch_size", low=1)
    integer(section, "max_prefill_tokens", low=1)
    integer(section, "num_threads", low=1, optional=True)


@dataclass(frozen=True)
class AgentConfig:
    """Multi-turn episodes of tool tasks (task.name 'calculator', 'search'): budgets and tool limits.
    rollout.sampling.max_new_tokens is an episode's budget of policy tokens over all its turns."""

    SECTION = "rollout.agent"

    max_turns: int = 4
    """Policy turns per episode (tool calls + the final answer); a tool call on the last allowed
    turn ends the episode there, not run. >= 1."""

    max_turn_tokens: int | None = None
    """Tokens of one policy turn. None: only the episode's budgets. >= 1."""

    max_response_tokens: int = 512
    """Policy + observation (tool output) tokens per episode: model.max_prompt_len plus this must
    fit model.max_seq_len. >= rollout.sampling.max_new_tokens."""

    tool_timeout_s: float = 5.0
    """Wall-clock limit of one tool call; past it the call's observation is an error. Positive, finite."""

    max_tool_output_chars: int = 1000
    """Characters of one tool call's output kept in the observation (the rest cut, marked). >= 1."""

    tool_workers: int = 4
    """Threads running tool calls (the controller never waits on a tool). >= 1."""

    def __post_init__(self) -> None:
        integer(self, "max_turns", low=1)
        integer(self, "max_turn_tokens", low=1, optional=True)
        integer(self, "max_response_tokens", low=1)
        number(self, "tool_timeout_s", low=0, high=math.inf, low_open=True, high_open=True)
        integer(self, "max_tool_output_chars", low=1)
        integer(self, "tool_workers", low=1)


@dataclass(frozen=True)
class RolloutConfig:
    """Inference engines that generate the training samples."""

    SECTION = "rollout"

    engine: Engine = "embedded"
    """One of ENGINES: 'embedded' (HF transformers in its own process; CPU) or 'sglang' (SGLang
    servers: on GPUs, or on the CPU with launcher.device 'cpu')."""

    num_engines: int = 1
    """Engine processes (SGLang servers, each of sglang.tp_size GPUs). In [1, MAX_ENGINES]."""

    dtype: EmbeddedDtype | SGLangDtype = "float32"
    """Engine numerics. embedded: float32 | bfloat16; sglang: auto | bfloat16 | float16 | float32.
    A dtype other than the learner's makes the train-inference mismatch real."""

    quantize: Quantize = "none"
    """Round the engine's linear-layer weights to FP8 e4m3 ('fp8'), as FP8 rollout does on GPU (verl, slime,
    NeMo-RL): the attention and MLP projections; embeddings, norms, biases, the output layer and MoE routers keep
    `dtype`, which the matmuls still run in (`rollout/quantize.py`). Re-applied to every weight update. Embedded
    engine only ('none' for sglang: SGLang's own `--quantization fp8` needs the learner to send FP8 weights and
    scales, which the weight sync does not do yet; docs/ENTR.md, "Engine-side mismatch: FP8 rollout")."""

    quantize_scale: QuantizeScale = "per_channel"
    """With quantize 'fp8': one scale amax / 448 per weight tensor ('per_tensor'), per output channel
    ('per_channel'), or per 128 x 128 tile ('block', DeepSeek-V3's layout that verl's FP8 rollout uses)."""

    quantize_activations: bool = False
    """With quantize 'fp8': also round each linear layer's input to e4m3 with a scale computed from the input itself,
    per tensor, per token or per 1 x 128 group of a token (following quantize_scale), as W8A8 kernels do."""

    prompts_per_step: int = 8
    """Prompts (groups) per training step; a step trains on prompts_per_step * sampling.n sequences. In
    [1, MAX_PROMPTS_PER_STEP]."""

    dynamic_filtering: bool = False
    """Drop groups whose rewards are all equal (zero advantage, no gradient) and sample more
    prompts until the step is full (DAPO); the dropped groups are counted in the metrics."""

    kv_on_update: KvOnUpdate | None = None
    """After a weight update, 'keep' the KV cache of in-flight requests (no stall) or 'recompute'
    it. None: the engine's default (embedded keep, sglang recompute)."""

    weight_bucket_mib: int | None = None
    """Size of one weight-sync bucket in MiB. None: DEFAULT_WEIGHT_BUCKET_MIB (512). >= 1."""

    weight_snapshot: WeightSnapshot = "borrow"
    """How the learner holds the weights it is sending (one of WEIGHT_SNAPSHOTS). 'borrow': parameters
    go on the wire straight from where they are (no copy; re-laid-out or gathered tensors are
    copied), and the next optimizer step waits until they are sent (forward and backward do not).
    'copy': everything is copied into host buffers first (one more copy of the stage's weights in
    memory and CPU time), and the learner never waits for the wire."""

    placement: Placement = "separate"
    """Where the engines run against the learner (one of PLACEMENTS). 'separate': weights broadcast over
    a gloo/NCCL group. 'colocated': each learner stage copies its buckets straight into the engine's
    staging copy (weight_sync/colocated.py; no NCCL group, so a run fits on one GPU), bucketed and
    versioned as on the broadcast path: in host shared memory (from a GPU learner device-to-host),
    or with rollout.embedded.device 'cuda' in the engine's GPU memory through a CUDA IPC handle.
    Engines on the learner's host, as the same user. SGLang servers (engine 'sglang', CPU): the
    learner's snapshot in shared memory (/dev/shm holds one copy of the weights), each bucket loaded
    from there by SGLang's /update_weights_from_tensor
    (weight_sync SGLangTensorTransport; launcher.kind 'local', one node, servers it launches or
    given by loopback urls)."""

    max_engine_restarts: int = 3
    """Engines that died or stopped answering and were replaced during one `train` job: embedded
    engines (a new process, or a new Ray actor with launcher.kind 'ray') and SGLang servers
    `train` launched (relaunched on their port); the learner's weights are pushed to it and its
    groups generated again. One more failure ends the job with the engine's last error. Servers
    given by rollout.sglang.urls are not restarted but set aside and probed
    (rollout.sglang.probe_interval_s). 0: none. >= 0."""

    push_timeout_s: float = 600.0
    """Seconds a weight push may take to reach every engine (embedded engines, SGLang servers);
    past it the engines are health-checked and an unresponsive one replaced (max_engine_restarts).
    Positive, finite."""

    poll_timeout_s: float = 120.0
    """Seconds the controller waits without any finished sample before it health-checks the
    engines (embedded: rollout.embedded.health_timeout_s; SGLang: /model_info within
    rollout.sglang.request_timeout_s); engines that answer keep generating. Positive, finite."""

    record_routes: bool = False
    """Return, with each sample, the experts every MoE layer routed each token to (free for dense
    models). The controller also turns it on for algorithm.routing_replay 'r3'. SGLang: servers
    `train` launches get --enable-return-routed-experts; servers given by sglang.urls must have
    been started with it (an answer without routes fails the request, saying so)."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters, including the group size n."""

    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang server settings (used when engine is 'sglang')."""

    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    """Embedded engine settings (used when engine is 'embedded')."""

    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn episodes (tool tasks): turn and token budgets, tool limits."""

    def __post_init__(self) -> None:
        choice(self, "engine", Engine)
        integer(self, "num_engines", low=1, high=MAX_ENGINES)
        choice(self, "dtype", EmbeddedDtype if self.engine == "embedded" else SGLangDtype)
        integer(self, "prompts_per_step", low=1, high=MAX_PROMPTS_PER_STEP)
        boolean(self, "dynamic_filtering")
        if self.kv_on_update is not None:
            choice(self, "kv_on_update", KvOnUpdate)
        integer(self, "weight_bucket_mib", low=1, optional=True)
        choice(self, "weight_snapshot", WeightSnapshot)
        choice(self, "placement", Placement)
        integer(self, "max_engine_restarts", low=0)
        for name in ("push_timeout_s", "poll_timeout_s"):
            number(self, name, low=0, high=math.inf, low_open=True, high_open=True)
        boolean(self, "record_routes")
        choice(self, "quantize", Quantize)
        choice(self, "quantize_scale", QuantizeScale)
        boolean(self, "quantize_activations")
        if self.quantize != "none" and self.engine != "embedded":
            raise bad(self, "quantize", self.quantize,
                      "must be 'none': FP8 rounding is the embedded engine's (SGLang's --quantization fp8 would need "
                      "the learner to send FP8 weights and their scales; see docs/ENTR.md)", when=f"engine={self.engine!r}")
        if self.quantize_activations and self.quantize == "none":
            raise bad(self, "quantize_activations", True, "needs rollout.quantize 'fp8' (activations are rounded "
                      "only in an FP8 engine)", when="quantize='none'")

    @property
    def weight_bucket_bytes(self) -> int:
        """Bytes of one weight-sync bucket: weight_bucket_mib, or DEFAULT_WEIGHT_BUCKET_MIB when unset."""
        return (self.weight_bucket_mib or DEFAULT_WEIGHT_BUCKET_MIB) << 20

    @property
    def gpus_needed(self) -> int:
        """GPUs the engines occupy (0 for the embedded engine, which runs on CPU)."""
        return self.num_engines * self.sglang.tp_size if self.engine == "sglang" else 0  # CPU servers: run.py
