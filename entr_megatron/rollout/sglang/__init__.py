"""SGLang servers as rollout engines: launch them, talk to them, generate with them.

    servers = launch_servers([SGLangServerConfig(model_dir, tp_size=2, port=30000 + i) for i in range(4)],
                             log_dir="logs/sglang")                             # launcher.py
    engine = SGLangEngine(SGLangEngineConfig(urls=tuple(s.url for s in servers)))   # engine.py
    engine.submit([GenerateRequest(prompt_ids, SamplingParams(temperature=1.0, n=8))])
    results = engine.poll(timeout=1.0)
    # weights, on learner rank 0: weight_sync.SGLangTransport(engine, "10.0.0.1", 29600)

Modules: `protocol.py` the HTTP protocol of SGLang 0.5.23 (endpoints, the bodies we
build), `answers.py` how its answers are checked and read, `flat_bucket.py` the flattened
weight bucket, `client.py` one server's HTTP API and its errors (retries of idempotent calls,
the API key), `engine.py` the `RolloutEngine` (generation, answers checked before use; a weight
update pauses the servers around weight_sync's transfer) and `engine_config.py` its settings,
`launcher.py` server and router processes (on 127.0.0.1 unless configured, the key handed over
through the environment). Nothing here imports sglang.
"""

from entr_megatron.rollout.sglang.answers import BadAnswer, RouteLayout, parse_generate_output
from entr_megatron.rollout.sglang.client import SGLangClient, SGLangError, SGLangTimeout, api_key_from_env
from entr_megatron.rollout.sglang.engine import SGLangEngine, SGLangEngineConfig, WeightTransfer
from entr_megatron.rollout.sglang.flat_bucket import (
    FlatBucket,
    iter_flattened_buckets,
    pack_flattened_bucket,
    unpack_flattened_bucket,
)
from entr_megatron.rollout.sglang.launcher import (
    ManagedProcess,
    RouterConfig,
    SGLangServerConfig,
    launch_router,
    launch_servers,
    router_command,
    server_command,
    terminate_all,
)
from entr_megatron.rollout.sglang.protocol import (
    KV_ON_UPDATE,
    ROUTES_FLAG,
    SGLANG_SOURCE,
    SGLANG_VERSION,
    generate_payload,
    sample_seed,
    sampling_params_payload,
)

__all__ = [
    "KV_ON_UPDATE",
    "ROUTES_FLAG",
    "SGLANG_SOURCE",
    "SGLANG_VERSION",
    "BadAnswer",
    "FlatBucket",
    "ManagedProcess",
    "RouteLayout",
    "RouterConfig",
    "SGLangClient",
    "SGLangEngine",
    "SGLangEngineConfig",
    "SGLangError",
    "SGLangServerConfig",
    "SGLangTimeout",
    "WeightTransfer",
    "api_key_from_env",
    "generate_payload",
    "iter_flattened_buckets",
    "launch_router",
    "launch_servers",
    "pack_flattened_bucket",
    "parse_generate_output",
    "router_command",
    "sample_seed",
    "sampling_params_payload",
    "server_command",
    "terminate_all",
    "unpack_flattened_bucket",
]
