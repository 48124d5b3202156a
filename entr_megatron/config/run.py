"""The whole run: one typed, nested, frozen config validated before any process starts.

Layer L0: plain dataclasses, no torch/megatron and nothing from the package above
`config/`. The rollout sections mirror the user-facing fields of the engines
(`rollout/embedded.py`, `rollout/sglang_*.py`, `rollout/engine.SamplingParams`);
the controller translates them. Every error names the dotted field, the value and
what is allowed. YAML files and dotted overrides: see `loader.py`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from entr_megatron.config.algorithm import AlgorithmConfig
from entr_megatron.config.learner import LearnerConfig

MODEL_DTYPES = ("float32", "bfloat16")
ENGINES = ("embedded", "sglang")
EMBEDDED_DTYPES = ("float32", "bfloat16")
SGLANG_DTYPES = ("auto", "bfloat16", "float16", "float32")
WEIGHT_SNAPSHOTS = ("borrow", "copy")
KV_ON_UPDATE = ("keep", "recompute")
ROUTER_POLICIES = ("cache_aware", "round_robin", "random")
CONTROLLER_MODES = ("sync", "one_step_off", "fully_async")
STALE_POLICIES = ("drop", "regenerate")
TASK_NAMES = ("arithmetic", "math", "calculator")
ARITHMETIC_OPERATIONS = ("+", "-", "*")
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
LAUNCHERS = ("local", "ray")
DEVICES = ("cpu", "cuda")
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_POLICY_LAG_LIMIT = 1024
"""Upper bound of controller.max_policy_lag (far beyond any useful staleness; keeps the buffer's
version history bounded)."""

# learner.precision spells the same thing as model.dtype with Megatron's names.
PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}


# ---------------------------------------------------------------- validation helpers


def _bad(path: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{path}={value!r} is not valid; {rule}")


def _choice(path: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise _bad(path, value, f"allowed: {', '.join(allowed)}")


def _int(path: str, value: Any, low: int = 0, high: int | None = None, optional: bool = False) -> None:
    if optional and value is None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    if not ok:
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _bad(path, value, f"must be {'null or ' if optional else ''}an integer {span}")


def _num(path: str, value: Any, low: float, high: float = math.inf, low_open: bool = False, optional: bool = False):
    if optional and value is None:
        return
    rule = f"must be {'null or ' if optional else ''}a number in {'(' if low_open else '['}{low:g}, {high:g}]"
    # bool is an int subclass: `lr: true` in YAML is a typo, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise _bad(path, value, rule)
    if (value <= low if low_open else value < low) or value > high:
        raise _bad(path, value, rule)


def _bool(path: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _bad(path, value, "must be true or false")


def _str(path: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        raise _bad(path, value, f"must be {'null or ' if optional else ''}a non-empty string")


def _str_tuple(obj: Any, name: str, path: str, allowed: tuple[str, ...] | None = None) -> None:
    """Lists from YAML become tuples (frozen, hashable); every item must be a string."""
    value = getattr(obj, name)
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise _bad(path, value, "must be a list of strings")
    for item in value:
        if not isinstance(item, str) or (allowed is not None and item not in allowed):
            extra = f" from: {', '.join(allowed)}" if allowed else ""
            raise _bad(path, value, f"must be a list of strings{extra}")
    object.__setattr__(obj, name, tuple(value))


def _url_tuple(obj: Any, name: str, path: str) -> None:
    """A non-empty list of distinct http(s)://host[:port] URLs, stored as a tuple without trailing '/'."""
    value = getattr(obj, name)
    rule = "must be null or a non-empty list of distinct http:// or https:// URLs (e.g. http://10.0.0.2:30000)"
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise _bad(path, value, rule)
    urls = []
    for item in value:
        if not isinstance(item, str):
            raise _bad(path, value, rule)
        try:
            parts = urlsplit(item)
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise _bad(path, value, f"{rule}; {item!r} is not a URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _bad(path, value, f"{rule}; {item!r} is not one")
        urls.append(item.rstrip("/"))
    if len(set(urls)) != len(urls):
        raise _bad(path, value, f"{rule}; a server is listed twice")
    object.__setattr__(obj, name, tuple(urls))


# ---------------------------------------------------------------- model and parallelism

# A tiny Qwen3-style model, so RunConfig() is valid and small enough for a CPU.
DEFAULT_ARCHITECTURE: dict[str, Any] = {
    "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class ModelConfig:
    """The policy model: where it comes from, its dtype and its sequence limits."""

    path: str | None = None
    """HF model directory (config.json, optionally safetensors) or a config.json file. None:
    build the model from `architecture` (random init; the SFT warm-up or the run saves it
    into the run directory)."""

    architecture: dict[str, Any] | None = field(default_factory=lambda: dict(DEFAULT_ARCHITECTURE))
    """HF config fields (model_type, hidden_size, num_hidden_layers, ...) of a model built from
    scratch when `path` is null (default: a tiny Qwen3). vocab_size may be left out: the task's
    tokenizer sets it. Set either this or `path`; with `path` the default becomes null."""

    tokenizer: str | None = None
    """HF tokenizer directory. None: the model directory's tokenizer, or the one the synthetic
    task builds locally."""

    dtype: str = "float32"
    """Learner weights and compute: one of MODEL_DTYPES. Must agree with learner.precision
    (the loader fills learner.precision from it when the config leaves that unset)."""

    max_prompt_len: int = 512
    """Longest prompt in tokens; longer prompts are skipped and counted. >= 1."""

    max_seq_len: int = 2048
    """Prompt + response limit in tokens (positions the model must cover). >= 2; at least
    max_prompt_len + rollout.sampling.max_new_tokens."""

    def __post_init__(self) -> None:
        _str("model.path", self.path, optional=True)
        if self.architecture is not None and not isinstance(self.architecture, dict):
            raise _bad("model.architecture", self.architecture, "must be null or a mapping of HF config fields")
        if self.path is not None and self.architecture == DEFAULT_ARCHITECTURE:
            object.__setattr__(self, "architecture", None)  # the default applies to path-less models only
        if self.path is not None and self.architecture:
            raise _bad(
                "model.architecture", self.architecture, "must be null when model.path is set (one or the other)"
            )
        if self.path is None and not self.architecture:
            raise _bad("model.path", None, "set model.path (an HF model dir or config.json) or model.architecture")
        if self.path is None and "model_type" not in self.architecture:
            raise _bad("model.architecture", self.architecture, "must name its model_type (e.g. qwen3)")
        _str("model.tokenizer", self.tokenizer, optional=True)
        _choice("model.dtype", self.dtype, MODEL_DTYPES)
        _int("model.max_prompt_len", self.max_prompt_len, low=1)
        _int("model.max_seq_len", self.max_seq_len, low=2)


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallelism of the learner. Its world size is launcher.nnodes * nproc_per_node."""

    tp: int = 1
    """Tensor-parallel size. >= 1."""

    pp: int = 1
    """Pipeline-parallel size. >= 1."""

    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule). None or >= 2; needs pp >= 2."""

    cp: int = 1
    """Context-parallel size (sequence split over ranks in attention). >= 1."""

    ep: int = 1
    """Expert-parallel size (MoE models). >= 1; ep * expert_tp must divide tp * cp * dp."""

    expert_tp: int = 1
    """Tensor-parallel size inside the experts (Megatron's expert_tensor_parallel_size). >= 1."""

    dp: int | None = None
    """Data-parallel size. None: derived as world_size / (tp * pp * cp); if set, tp * pp * cp * dp
    must equal the world size."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism (norms/dropout sharded over the TP group); needs tp >= 2."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "expert_tp"):
            _int(f"parallel.{name}", getattr(self, name), low=1)
        _int("parallel.vpp", self.vpp, low=2, optional=True)
        _int("parallel.dp", self.dp, low=1, optional=True)
        _bool("parallel.sequence_parallel", self.sequence_parallel)
        if self.vpp is not None and self.pp < 2:
            raise _bad("parallel.vpp", self.vpp, f"needs parallel.pp >= 2 (pp={self.pp}); use null")
        if self.ep > 1 and self.tp > 1 and not self.sequence_parallel:
            raise _bad(
                "parallel.sequence_parallel", False,
                f"Megatron needs it with expert and tensor parallelism (ep={self.ep}, tp={self.tp}); use true",
            )
        if self.sequence_parallel and self.tp < 2:
            raise _bad("parallel.sequence_parallel", True, f"needs parallel.tp >= 2 (tp={self.tp}); use false")

    def data_parallel_size(self, world_size: int) -> int:
        """dp for a learner of `world_size` ranks (the set value, or the derived one)."""
        model_parallel = self.tp * self.pp * self.cp
        return self.dp if self.dp is not None else world_size // model_parallel


# ---------------------------------------------------------------- rollout


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled (mirrors rollout.engine.SamplingParams)."""

    temperature: float = 1.0
    """Logits are divided by it. > 0 (RL needs a stochastic policy). The loader copies it into
    learner.temperature unless that is set; the two must agree."""

    top_p: float = 1.0
    """Nucleus truncation; 1.0 keeps every token. In (0, 1]."""

    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0: no top-k. >= -1."""

    max_new_tokens: int = 128
    """Response length limit in tokens. >= 1."""

    n: int = 8
    """Samples per prompt: the GRPO group size. >= 2 (group advantages need a baseline)."""

    def __post_init__(self) -> None:
        _num("rollout.sampling.temperature", self.temperature, low=0.0, low_open=True)
        _num("rollout.sampling.top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _int("rollout.sampling.top_k", self.top_k, low=-1)
        _int("rollout.sampling.max_new_tokens", self.max_new_tokens, low=1)
        _int("rollout.sampling.n", self.n, low=2)


@dataclass(frozen=True)
class SGLangConfig:
    """SGLang servers (`python -m sglang.launch_server`), started by the launcher on GPU nodes."""

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

    router_policy: str = "cache_aware"
    """Router load-balancing policy: one of ROUTER_POLICIES."""

    max_concurrent_requests: int = 256
    """Requests in flight per server from the controller. >= 1."""

    startup_timeout_s: float = 1800.0
    """Seconds to wait for a server to load its model. > 0."""

    urls: tuple[str, ...] | None = None
    """Already running servers (http:// or https://host:port), one per engine (rollout.num_engines
    of them): `train` launches nothing and drives these, and tp_size, mem_fraction_static,
    base_port, extra_args and startup_timeout_s do not apply (the servers' own flags do). The
    servers must reach learner rank 0, which hosts the weight-update group (launcher.master_addr;
    with Ray, rank 0's node IP);
    their weights are overwritten by the learner's before the first rollout. Any launcher.device
    works (the servers run elsewhere). None: `train` launches rollout.num_engines servers on its
    own node (launcher.kind 'local', one node, no engine_nodes), on the GPUs after the learner's."""

    def __post_init__(self) -> None:
        if self.urls is not None:
            _url_tuple(self, "urls", "rollout.sglang.urls")
        _int("rollout.sglang.tp_size", self.tp_size, low=1)
        if self.mem_fraction_static is not None:
            _num("rollout.sglang.mem_fraction_static", self.mem_fraction_static, low=0.0, high=0.99, low_open=True)
        _int("rollout.sglang.base_port", self.base_port, low=1024, high=65535)
        _str_tuple(self, "extra_args", "rollout.sglang.extra_args")
        _bool("rollout.sglang.router", self.router)
        _choice("rollout.sglang.router_policy", self.router_policy, ROUTER_POLICIES)
        _int("rollout.sglang.max_concurrent_requests", self.max_concurrent_requests, low=1)
        _num("rollout.sglang.startup_timeout_s", self.startup_timeout_s, low=0.0, low_open=True)


@dataclass(frozen=True)
class EmbeddedConfig:
    """The embedded engine (HF transformers, CPU or one GPU), each in its own process."""

    max_batch_size: int = 32
    """Samples decoded together; more wait. >= 1."""

    max_prefill_tokens: int = 8192
    """Padded prompt tokens admitted in one prefill. >= 1."""

    num_threads: int | None = None
    """torch intra-op threads of each engine process. None: torch's default. >= 1."""

    def __post_init__(self) -> None:
        _int("rollout.embedded.max_batch_size", self.max_batch_size, low=1)
        _int("rollout.embedded.max_prefill_tokens", self.max_prefill_tokens, low=1)
        _int("rollout.embedded.num_threads", self.num_threads, low=1, optional=True)


@dataclass(frozen=True)
class RolloutConfig:
    """Inference engines that generate the training samples."""

    engine: str = "embedded"
    """One of ENGINES: 'embedded' (HF transformers in its own process; CPU) or 'sglang' (GPU servers)."""

    num_engines: int = 1
    """Engine processes (SGLang servers, each of sglang.tp_size GPUs). >= 1."""

    dtype: str = "float32"
    """Engine numerics. embedded: float32 | bfloat16; sglang: auto | bfloat16 | float16 | float32.
    A dtype other than the learner's makes the train-inference mismatch real."""

    prompts_per_step: int = 8
    """Prompts (groups) per training step; a step trains on prompts_per_step * sampling.n sequences. >= 1."""

    dynamic_filtering: bool = False
    """Drop groups whose rewards are all equal (zero advantage, no gradient) and sample more
    prompts until the step is full (DAPO); the dropped groups are counted in the metrics."""

    kv_on_update: str | None = None
    """After a weight update, 'keep' the KV cache of in-flight requests (no stall) or 'recompute'
    it. None: the engine's default (embedded keep, sglang recompute)."""

    weight_bucket_mib: int | None = None
    """Size of one weight-sync bucket in MiB. None: 512. >= 1."""

    weight_snapshot: str = "borrow"
    """How the learner holds the weights it is sending (one of WEIGHT_SNAPSHOTS). 'borrow': parameters
    go on the wire straight from where they are (no copy; re-laid-out or gathered tensors are
    copied), and the next optimizer step waits until they are sent (forward and backward do not).
    'copy': everything is copied into host buffers first (one more copy of the stage's weights in
    memory and CPU time), and the learner never waits for the wire."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters, including the group size n."""

    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang server settings (used when engine is 'sglang')."""

    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    """Embedded engine settings (used when engine is 'embedded')."""

    def __post_init__(self) -> None:
        _choice("rollout.engine", self.engine, ENGINES)
        _int("rollout.num_engines", self.num_engines, low=1)
        _choice("rollout.dtype", self.dtype, EMBEDDED_DTYPES if self.engine == "embedded" else SGLANG_DTYPES)
        _int("rollout.prompts_per_step", self.prompts_per_step, low=1)
        _bool("rollout.dynamic_filtering", self.dynamic_filtering)
        if self.kv_on_update is not None:
            _choice("rollout.kv_on_update", self.kv_on_update, KV_ON_UPDATE)
        _int("rollout.weight_bucket_mib", self.weight_bucket_mib, low=1, optional=True)
        _choice("rollout.weight_snapshot", self.weight_snapshot, WEIGHT_SNAPSHOTS)

    @property
    def gpus_needed(self) -> int:
        """GPUs the engines occupy (0 for the embedded engine, which runs on CPU)."""
        return self.num_engines * self.sglang.tp_size if self.engine == "sglang" else 0


# ---------------------------------------------------------------- controller and task


@dataclass(frozen=True)
class ControllerConfig:
    """The training loop: mode, staleness bound, steps, checkpoints, evaluation."""

    mode: str = "fully_async"
    """One of CONTROLLER_MODES. 'sync': generate, train, update (synchronous GRPO);
    'one_step_off': generation of step k+1 overlaps training on step k; 'fully_async': engines
    never stop, weights are pushed in flight, unfinished generations continue across updates."""

    max_policy_lag: int = 4
    """Hard staleness bound in policy versions: a sample trained at version v must have every
    token generated by a policy of version >= v - max_policy_lag. 0: strictly on-policy (sync
    only). >= 0, up to MAX_POLICY_LAG_LIMIT; one_step_off and fully_async need >= 1."""

    stale_policy: str = "regenerate"
    """What happens to a sample over the bound: 'drop' it or 'regenerate' its prompt. Counted either way."""

    train_steps: int = 100
    """Training steps (= policy versions published) of the run. >= 1."""

    global_batch_size: int | None = None
    """Sequences per training step. None: rollout.prompts_per_step * rollout.sampling.n; if set it
    must equal that product."""

    checkpoint_interval: int = 0
    """Save a checkpoint every this many steps; 0: only at the end (and on Ctrl-C). >= 0."""

    keep_last_checkpoints: int = 2
    """Checkpoints kept in the run directory; older ones are deleted. 0 keeps all. >= 0."""

    eval_interval: int = 0
    """Evaluate on the held-out set every this many steps; 0: only before and after training. >= 0."""

    seed: int = 0
    """Seed of data order, sampling and initialisation. >= 0."""

    def __post_init__(self) -> None:
        _choice("controller.mode", self.mode, CONTROLLER_MODES)
        _int("controller.max_policy_lag", self.max_policy_lag, low=0, high=MAX_POLICY_LAG_LIMIT)
        if self.mode != "sync" and self.max_policy_lag < 1:
            raise _bad(
                "controller.max_policy_lag", self.max_policy_lag,
                f"controller.mode={self.mode!r} trains on samples at least one version old; must be >= 1 "
                "(or use mode 'sync')",
            )
        _choice("controller.stale_policy", self.stale_policy, STALE_POLICIES)
        _int("controller.train_steps", self.train_steps, low=1)
        _int("controller.global_batch_size", self.global_batch_size, low=1, optional=True)
        for name in ("checkpoint_interval", "keep_last_checkpoints", "eval_interval", "seed"):
            _int(f"controller.{name}", getattr(self, name), low=0)


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    """Synthetic multi-digit arithmetic, generated locally; exact-match reward."""

    digits: int = 2
    """Digits of each operand (1 .. 10^digits - 1). In [1, 9]."""

    operations: tuple[str, ...] = ("+", "-")
    """Operators drawn uniformly, from ARITHMETIC_OPERATIONS."""

    reverse_answer: bool = False
    """Write answers least significant digit first (far easier for a tiny causal model)."""

    pad_operands: bool = False
    """Operands with leading zeros to `digits` places ("07+45="): fixed digit positions."""

    format_reward: float = 0.0
    """Reward of a wrong but well-formed answer (an integer, then EOS). In [0, 1)."""

    def __post_init__(self) -> None:
        _int("task.arithmetic.digits", self.digits, low=1, high=9)
        _bool("task.arithmetic.reverse_answer", self.reverse_answer)
        _bool("task.arithmetic.pad_operands", self.pad_operands)
        _num("task.arithmetic.format_reward", self.format_reward, 0.0, 1.0)
        if self.format_reward >= 1.0:
            raise _bad("task.arithmetic.format_reward", self.format_reward, "must be < 1 (a correct answer earns 1)")
        _str_tuple(self, "operations", "task.arithmetic.operations", ARITHMETIC_OPERATIONS)
        if not self.operations:
            allowed = ", ".join(ARITHMETIC_OPERATIONS)
            raise _bad("task.arithmetic.operations", [], f"must name at least one of {allowed}")


@dataclass(frozen=True)
class MathTaskConfig:
    """Math problems from JSONL/Parquet files; math-verify reward."""

    train_files: tuple[str, ...] = ()
    """Training problems (.jsonl, .json or .parquet). Required when task.name is 'math'."""

    eval_files: tuple[str, ...] = ()
    """Held-out problems; empty: the last task.eval_size training problems are held out."""

    prompt_key: str = "problem"
    """Column holding the problem text."""

    answer_key: str = "answer"
    """Column holding the reference answer."""

    def __post_init__(self) -> None:
        for name in ("train_files", "eval_files"):
            path = f"task.math.{name}"
            _str_tuple(self, name, path)
            for file in getattr(self, name):
                if not file.endswith(DATA_FILE_SUFFIXES):
                    raise _bad(path, file, f"files must end with one of {', '.join(DATA_FILE_SUFFIXES)}")
        _str("task.math.prompt_key", self.prompt_key)
        _str("task.math.answer_key", self.answer_key)


@dataclass(frozen=True)
class CalculatorTaskConfig:
    """Multi-turn arithmetic where the model may call a calculator tool."""

    digits: int = 4
    """Digits of each operand. In [1, 18]."""

    max_turns: int = 4
    """Model turns (tool calls + final answer) per episode. >= 1."""

    def __post_init__(self) -> None:
        _int("task.calculator.digits", self.digits, low=1, high=18)
        _int("task.calculator.max_turns", self.max_turns, low=1)


@dataclass(frozen=True)
class TaskConfig:
    """What the policy is trained on and how it is rewarded."""

    name: str = "arithmetic"
    """One of TASK_NAMES; its options live in the section of the same name."""

    eval_size: int = 200
    """Held-out problems scored before/after training and every controller.eval_interval. >= 0."""

    arithmetic: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)
    """Options of the 'arithmetic' task."""

    math: MathTaskConfig = field(default_factory=MathTaskConfig)
    """Options of the 'math' task."""

    calculator: CalculatorTaskConfig = field(default_factory=CalculatorTaskConfig)
    """Options of the 'calculator' task."""

    def __post_init__(self) -> None:
        _choice("task.name", self.name, TASK_NAMES)
        _int("task.eval_size", self.eval_size, low=0)
        if self.name == "math" and not self.math.train_files:
            raise _bad("task.math.train_files", [], "task.name='math' needs at least one .jsonl/.json/.parquet file")


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-up before RL (RL from random weights learns nothing)."""

    steps: int = 200
    """Optimizer steps of the warm-up. >= 1."""

    lr: float = 1e-3
    """Constant learning rate of the warm-up. > 0."""

    batch_size: int = 32
    """Sequences per warm-up step. >= 1."""

    data_files: tuple[str, ...] = ()
    """Demonstrations (.jsonl/.json/.parquet with prompt and response). Empty: generated by the task."""

    def __post_init__(self) -> None:
        _int("sft.steps", self.steps, low=1)
        _num("sft.lr", self.lr, low=0.0, low_open=True)
        _int("sft.batch_size", self.batch_size, low=1)
        _str_tuple(self, "data_files", "sft.data_files")


# ---------------------------------------------------------------- launcher and logging


@dataclass(frozen=True)
class LauncherConfig:
    """Where the processes run. Learner world size = nnodes * nproc_per_node."""

    kind: str = "local"
    """One of LAUNCHERS: 'local' processes (torch.distributed) or 'ray' actors in placement groups."""

    device: str = "cpu"
    """One of DEVICES: 'cpu' (gloo) or 'cuda' (NCCL, one GPU per learner rank)."""

    nnodes: int = 1
    """Nodes the learner spans. >= 1."""

    nproc_per_node: int = 1
    """Learner ranks per node (on cuda: GPUs per node given to the learner). >= 1."""

    gpus_per_node: int = 0
    """GPUs on each node (placement); 0 on CPU. On cuda: >= nproc_per_node."""

    engine_nodes: int = 0
    """Extra nodes for the rollout engines; 0: engines use the learner nodes' remaining GPUs (or CPU). >= 0."""

    ray_address: str | None = None
    """kind 'ray': address of an existing cluster ('auto' or 'host:port'); None starts a local one."""

    master_addr: str = "127.0.0.1"
    """Rendezvous address of learner rank 0 (torchrun's --master-addr)."""

    master_port: int = 0
    """Rendezvous port; 0 picks a free one (single node only). In [0, 65535]."""

    cpu_threads_per_rank: int | None = None
    """torch intra-op threads of each learner rank. None: torch's default. >= 1."""

    def __post_init__(self) -> None:
        _choice("launcher.kind", self.kind, LAUNCHERS)
        _choice("launcher.device", self.device, DEVICES)
        _int("launcher.nnodes", self.nnodes, low=1)
        _int("launcher.nproc_per_node", self.nproc_per_node, low=1)
        _int("launcher.gpus_per_node", self.gpus_per_node, low=0)
        _int("launcher.engine_nodes", self.engine_nodes, low=0)
        _str("launcher.ray_address", self.ray_address, optional=True)
        _str("launcher.master_addr", self.master_addr)
        _int("launcher.master_port", self.master_port, low=0, high=65535)
        _int("launcher.cpu_threads_per_rank", self.cpu_threads_per_rank, low=1, optional=True)
        if self.ray_address is not None and self.kind != "ray":
            raise _bad("launcher.ray_address", self.ray_address, "is only used with launcher.kind='ray'; use null")
        if self.device == "cuda" and self.gpus_per_node < self.nproc_per_node:
            raise _bad(
                "launcher.gpus_per_node", self.gpus_per_node,
                f"launcher.device='cuda' needs >= launcher.nproc_per_node={self.nproc_per_node} GPUs per node",
            )
        if self.kind == "local" and self.nnodes > 1 and self.master_port == 0:
            raise _bad("launcher.master_port", 0, "a multi-node local launch needs a fixed port in [1, 65535]")

    @property
    def world_size(self) -> int:
        """Learner ranks."""
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True)
class LoggingConfig:
    """Run directory, metrics and console output."""

    run_dir: str = "runs/entr"
    """Directory of metrics.jsonl, TensorBoard events, checkpoints and logs (the CLI's --run-dir wins)."""

    tensorboard: bool = True
    """Write TensorBoard events next to metrics.jsonl."""

    progress_bar: bool = True
    """Show a progress bar with reward, throughput and lag (off: one log line per log_interval)."""

    log_interval: int = 1
    """Steps between console log lines / metrics.jsonl records. >= 1."""

    level: str = "info"
    """Console log level: one of LOG_LEVELS."""

    def __post_init__(self) -> None:
        _str("logging.run_dir", self.run_dir)
        _bool("logging.tensorboard", self.tensorboard)
        _bool("logging.progress_bar", self.progress_bar)
        _int("logging.log_interval", self.log_interval, low=1)
        _choice("logging.level", self.level, LOG_LEVELS)


# ---------------------------------------------------------------- the run


@dataclass(frozen=True)
class RunConfig:
    """One training run; every section validated, then the cross-section rules below."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallelism of the learner."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, off-policy correction (ENTR), policy loss."""

    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Packing, optimizer and LR schedule of the learner."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Inference engines and sampling."""

    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """The training loop."""

    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and rewards."""

    sft: SFTConfig | None = None
    """Supervised warm-up before RL; null skips it."""

    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """Processes and placement."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run directory and output."""

    def __post_init__(self) -> None:
        self._check_parallel()
        self._check_rollout()
        if self.learner.precision != PRECISION_OF_DTYPE[self.model.dtype]:
            raise _bad(
                "learner.precision", self.learner.precision,
                f"must agree with model.dtype={self.model.dtype!r} "
                f"(learner.precision={PRECISION_OF_DTYPE[self.model.dtype]!r})",
            )
        if not math.isclose(self.learner.temperature, self.rollout.sampling.temperature):
            raise _bad(
                "learner.temperature", self.learner.temperature,
                f"must equal rollout.sampling.temperature={self.rollout.sampling.temperature!r} "
                "(log-probs are taken of the distribution the engines sampled)",
            )
        if self.model.max_prompt_len + self.rollout.sampling.max_new_tokens > self.model.max_seq_len:
            raise _bad(
                "model.max_seq_len", self.model.max_seq_len,
                f"must be >= model.max_prompt_len + rollout.sampling.max_new_tokens = "
                f"{self.model.max_prompt_len + self.rollout.sampling.max_new_tokens}",
            )
        expected = self.rollout.prompts_per_step * self.rollout.sampling.n
        if self.controller.global_batch_size not in (None, expected):
            raise _bad(
                "controller.global_batch_size", self.controller.global_batch_size,
                f"must equal rollout.prompts_per_step * rollout.sampling.n = {expected} (or be null)",
            )
        dp = self.parallel.data_parallel_size(self.launcher.world_size)
        if self.learner.mini_batches * dp > expected:
            raise _bad(
                "learner.mini_batches", self.learner.mini_batches,
                f"must be at most {max(expected // dp, 1)}: each mini-batch of the {expected} sequences of a step "
                f"(rollout.prompts_per_step * rollout.sampling.n) needs one per data-parallel rank (dp={dp})",
            )
        if self.algorithm.loss_norm_tokens is None:
            # Dr.GRPO's constant: the generation budget (the loss of a sequence then does not
            # depend on how long its batch-mates are).
            algorithm = dataclasses.replace(self.algorithm, loss_norm_tokens=self.rollout.sampling.max_new_tokens)
            object.__setattr__(self, "algorithm", algorithm)

    def _check_parallel(self) -> None:
        p, world = self.parallel, self.launcher.world_size
        model_parallel = p.tp * p.pp * p.cp
        if p.dp is None and world % model_parallel:
            raise _bad(
                "parallel.tp", p.tp,
                f"tp * pp * cp = {model_parallel} must divide the learner world size {world} "
                "(launcher.nnodes * launcher.nproc_per_node)",
            )
        if p.dp is not None and model_parallel * p.dp != world:
            raise _bad(
                "parallel.dp", p.dp,
                f"tp * pp * cp * dp = {model_parallel * p.dp} must equal the learner world size {world} "
                "(launcher.nnodes * launcher.nproc_per_node); null derives it",
            )
        dp = p.data_parallel_size(world)
        if (p.tp * p.cp * dp) % (p.ep * p.expert_tp):
            raise _bad(
                "parallel.ep", p.ep,
                f"ep * expert_tp = {p.ep * p.expert_tp} must divide tp * cp * dp = {p.tp * p.cp * dp}",
            )

    def _check_rollout(self) -> None:
        r, launcher = self.rollout, self.launcher
        if r.engine == "sglang":
            if self.parallel.pp != 1:
                raise _bad(
                    "parallel.pp", self.parallel.pp,
                    "rollout.engine='sglang' needs parallel.pp=1 (the servers take one weight-update group, "
                    "fed by learner rank 0; pipeline stages would each pause and update them separately)",
                )
            if r.sglang.urls is not None:  # servers run elsewhere: nothing to place, any learner device
                if len(r.sglang.urls) != r.num_engines:
                    raise _bad(
                        "rollout.num_engines", r.num_engines,
                        f"must equal the number of rollout.sglang.urls ({len(r.sglang.urls)}): one engine per server",
                    )
                return
            if launcher.device != "cuda":
                raise _bad(
                    "rollout.engine", "sglang",
                    "needs launcher.device='cuda' to launch SGLang servers (they run on GPUs); "
                    "or give running servers in rollout.sglang.urls",
                )
            total = (launcher.nnodes + launcher.engine_nodes) * launcher.gpus_per_node
            needed = launcher.world_size + r.gpus_needed
            if needed > total:
                raise _bad(
                    "rollout.num_engines", r.num_engines,
                    f"learner ({launcher.world_size} GPUs) + engines (num_engines * sglang.tp_size = "
                    f"{r.gpus_needed} GPUs) need {needed} GPUs, but (launcher.nnodes + launcher.engine_nodes) "
                    f"* launcher.gpus_per_node = {total}",
                )
            if r.sglang.tp_size > launcher.gpus_per_node:
                raise _bad(
                    "rollout.sglang.tp_size", r.sglang.tp_size,
                    f"a server must fit on one node: <= launcher.gpus_per_node={launcher.gpus_per_node}",
                )

    @property
    def global_batch_size(self) -> int:
        """Sequences per training step."""
        return self.rollout.prompts_per_step * self.rollout.sampling.n

    @property
    def data_parallel_size(self) -> int:
        """The learner's data-parallel size (set or derived from the world size)."""
        return self.parallel.data_parallel_size(self.launcher.world_size)
