"""What makes SGLang servers run on CPU, checked without SGLang: the pinned package list, our
stand-in for sgl_kernel's CPU ops (against a loop written from SGLang's Triton kernel), the
command and environment of a CPU server, and the checks that fail a server's start in seconds."""

from __future__ import annotations

import importlib.util
import re
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from entr_megatron.rollout.sglang.launcher import CPU_ENV, CPU_FLAGS, SGLangServerConfig, server_command
from entr_megatron.rollout.sglang.preflight import ServerStartError, check_interpreter, check_model_dir, check_port

ROOT = Path(__file__).resolve().parents[2]


def stand_in():
    """sglang_cpu/sgl_kernel loaded under another name (this process has no business with `sgl_kernel`)."""
    spec = importlib.util.spec_from_file_location("entr_sgl_kernel_stand_in", ROOT / "sglang_cpu/sgl_kernel/__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assign_reference(req_pool_indices, req_to_token, start, end, out_cache_loc):
    """SGLang's Triton kernel `assign_req_to_token_pool` (srt/mem_cache/allocation.py), one program per request."""
    offset = 0
    for i in range(len(req_pool_indices)):
        n = int(end[i] - start[i])
        row = int(req_pool_indices[i])
        for j in range(n):
            req_to_token[row, int(start[i]) + j] = out_cache_loc[offset + j]
        offset += n


@pytest.mark.parametrize("seed", range(6))
def test_assign_req_to_token_pool_matches_the_kernel(seed):
    g = torch.Generator().manual_seed(seed)
    rows, pool_len, batch = 9, 40, int(torch.randint(1, 7, (1,), generator=g))
    req_pool_indices = torch.randperm(rows, generator=g)[:batch].to(torch.int64)
    start = torch.randint(0, 20, (batch,), generator=g)
    end = start + torch.randint(0, 15, (batch,), generator=g)  # some requests write nothing
    if seed == 0:
        end[:] = start  # a batch that writes nothing at all
    total = int((end - start).sum())
    out_cache_loc = torch.randint(1, 10_000, (total + 3,), generator=g)  # SGLang's buffer may be longer
    want = torch.zeros(rows, pool_len, dtype=torch.int32)
    assign_reference(req_pool_indices, want, start.int(), end.int(), out_cache_loc)
    got = torch.zeros(rows, pool_len, dtype=torch.int32)
    stand_in().assign_req_to_token_pool_cpu(req_pool_indices, got, start.int(), end.int(), out_cache_loc, pool_len)
    assert torch.equal(got, want)


def test_stand_in_refuses_what_it_does_not_implement_and_claims_no_amx_kernels():
    module = stand_in()
    with pytest.raises(NotImplementedError, match="copy_all_layer_kv_cache_cpu"):
        module.copy_all_layer_kv_cache_cpu(None, None, None, None)
    assert set(module.UNSUPPORTED) <= set(dir(module))
    # SGLang picks its AMX kernels when this op exists (srt/utils/common.py _is_intel_amx_backend_available)
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
    with pytest.raises(ValueError, match="pool_len"):
        module.assign_req_to_token_pool_cpu(torch.zeros(1), torch.zeros(2, 5), torch.zeros(1), torch.zeros(1),
                                            torch.zeros(1), 4)


def test_requirements_pin_every_package_by_hash_without_gpu_kernels():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from sglang_cpu_requirements import GPU_ONLY, canonical
    finally:
        sys.path.pop(0)
    text = (ROOT / "requirements/sglang-cpu.txt").read_text()
    pins = re.findall(r"^([a-z0-9][a-z0-9._-]*)==(\S+) \\\n    --hash=sha256:([0-9a-f]{64})$", text, re.M)
    names = [canonical(n) for n, _, _ in pins]
    assert len(pins) == len([line for line in text.splitlines() if line and not line.startswith((" ", "#"))])
    assert ("sglang", "0.5.23") in {(n, v) for n, v, _ in pins} and ("torch", "2.14.1") in {(n, v) for n, v, _ in pins}
    assert len(names) == len(set(names)) > 150
    assert not set(names) & set(GPU_ONLY), "a GPU-only package is in the CPU list"
    assert {"apache-tvm-ffi", "triton"} <= set(names)  # imported at module level on every device


def test_cpu_server_command_and_environment():
    c = SGLangServerConfig("/m", port=31234, dtype="float32", device="cpu", max_total_tokens=4096,
                           python="/venv/bin/python", base_gpu_id=3, env={"OMP_NUM_THREADS": "1"})
    cmd = server_command(c)
    assert cmd[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    assert all(flag in cmd for flag in CPU_FLAGS) and "--base-gpu-id" not in cmd  # on CPU it names a NUMA node
    assert cmd[cmd.index("--max-total-tokens") + 1] == "4096" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert c.process_env == {**CPU_ENV, "OMP_NUM_THREADS": "1"}
    gpu = server_command(SGLangServerConfig("/m", base_gpu_id=3))
    assert "--device" not in gpu and gpu[gpu.index("--base-gpu-id") + 1] == "3"
    assert gpu[0] == sys.executable and SGLangServerConfig("/m").process_env == {}
    with pytest.raises(ValueError, match="device"):
        SGLangServerConfig("/m", device="tpu")


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text and not getattr(error, "__notes__", None), text
    return text


def test_start_checks_fail_in_seconds_with_one_line(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ServerStartError) as e:
        check_interpreter(str(tmp_path / "no-venv/bin/python"))
    assert "rollout.sglang.python" in one_line(e.value) and "setup_sglang_cpu.sh" in str(e.value)
    with pytest.raises(ServerStartError) as e:
        check_interpreter(sys.executable)  # our venv: no sglang
    assert "has no sglang installed" in one_line(e.value)
    with pytest.raises(ServerStartError) as e:
        check_model_dir(str(tmp_path / "nowhere"))
    assert "config.json" in one_line(e.value)
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ServerStartError, match="neither model_type nor architectures"):
        check_model_dir(str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerStartError) as e:
            check_port("127.0.0.1", port)
        assert f"127.0.0.1:{port} is taken" in one_line(e.value) and "base_port" in str(e.value)
    check_port("127.0.0.1", port)  # free again
    assert time.monotonic() - t0 < 30


def test_train_launches_cpu_servers_with_the_cpu_settings(tmp_path):
    from entr_megatron.config.loader import load_config
    from entr_megatron.config.rollout import CPU_MAX_TOTAL_TOKENS
    from entr_megatron.controller.job.sglang_servers import NO_PREFIX_CACHE, server_configs

    cfg = load_config(None, ["rollout.engine=sglang", "launcher.device=cpu", "rollout.kv_on_update=keep",
                             "rollout.sglang.python=.venv-sglang/bin/python", "rollout.num_engines=2"])
    a, b = server_configs(cfg, tmp_path, routes=False, threads=1)
    assert a.device == "cpu" and a.base_gpu_id is None and a.max_total_tokens == CPU_MAX_TOTAL_TOKENS
    assert a.python == str(Path(".venv-sglang/bin/python").absolute()) and a.env == {"OMP_NUM_THREADS": "1",
                                                                                       "GLOO_SOCKET_IFNAME": "lo"}
    assert NO_PREFIX_CACHE in a.extra_args and (a.port, b.port) == (30000, 30001)
    recompute = load_config(None, ["rollout.engine=sglang", "launcher.device=cpu", "rollout.sglang.max_total_tokens=512"])
    (c,) = server_configs(recompute, tmp_path, routes=False)
    assert NO_PREFIX_CACHE not in c.extra_args and c.max_total_tokens == 512 and "OMP_NUM_THREADS" not in c.env
    gpu = load_config(None, ["rollout.engine=sglang", "launcher.device=cuda", "launcher.gpus_per_node=2"])
    (g,) = server_configs(gpu, tmp_path, routes=False)
    assert g.device is None and g.max_total_tokens is None and g.base_gpu_id == 1 and g.python is None


def test_servers_given_by_url_for_kv_keep_must_run_without_the_prefix_cache(tmp_path):
    from contextlib import ExitStack

    from entr_megatron.config.loader import load_config
    from entr_megatron.controller.job.sglang_servers import start_servers

    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    from sglang_mock import MockSGLangServer

    for prefix_cache in (True, False):
        with MockSGLangServer(prefix_cache=prefix_cache) as server, ExitStack() as stack:
            cfg = load_config(None, ["rollout.engine=sglang", f"rollout.sglang.urls=['{server.url}']",
                                     "rollout.kv_on_update=keep"])
            if prefix_cache:
                with pytest.raises(ValueError, match=r"rollout\.kv_on_update='keep'.*--disable-radix-cache"):
                    start_servers(cfg, tmp_path, stack, tmp_path)
            else:
                assert start_servers(cfg, tmp_path, stack, tmp_path).urls == [server.url]
