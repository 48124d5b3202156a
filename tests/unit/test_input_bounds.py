"""Every input has a bound, checked before any work (issue 46): a config file's size, kind and YAML
structure (aliases expand into at most so many nodes), the planner's workload and costs (a
simulation that ends in seconds, numbers the random draws can take), learner ranks no more than
the cores that run them. Errors name the file or the dotted field and what would be valid."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import yaml

from entr_megatron.config.loader import load_config, parse_value, read_yaml
from helpers import sigint_default

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "cpu_demo.yaml"
COSTS = {"decode_base_s": 0.01, "decode_per_seq_s": 0.001, "prefill_per_token_s": 1e-4, "train_per_token_s": 1e-4,
         "train_overhead_s": 0.1, "push_s": 0.1, "swap_s": 0.01}
MAX_CONFIG_BYTES = 1 << 20
"""config.loader's bounds, as docs/TRAINING.md states them."""
MAX_CONFIG_NODES = 100_000


def _message(fn, *args, error=ValueError) -> str:
    with pytest.raises(error) as e:
        fn(*args)
    return str(e.value)


def _bomb(levels: int = 9, keys: int = 9) -> str:
    """`levels` levels of aliased mappings of `keys` keys under model.architecture (keys**levels leaves)."""
    lines = ["a0: &a0 {" + ", ".join(f"k{i}: 1.0" for i in range(keys)) + "}"]
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} {{" + ", ".join(f"k{i}: *a{level - 1}" for i in range(keys)) + "}")
    return "model:\n  architecture:\n    bomb:\n" + "".join(f"      {line}\n" for line in lines)


# --- the config file -------------------------------------------------------------------------


def test_an_alias_bomb_is_refused_in_well_under_a_second(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb())
    t0 = time.monotonic()
    msg = _message(load_config, path)
    assert time.monotonic() - t0 < 2.0
    assert msg.startswith(f"{path}: the YAML expands to more than {MAX_CONFIG_NODES} values"), msg
    assert "aliases (*name)" in msg, msg


def test_aliases_that_stay_small_still_load(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(DEMO.read_text() + "\nx-shared: &opt {lr: 1.0e-4}\n")
    data = read_yaml(str(path))
    assert data["x-shared"] == {"lr": 1e-4}
    path.write_text("a: &a {x: 1}\nb: *a\nc: [*a, *a]\n")
    assert read_yaml(str(path)) == {"a": {"x": 1}, "b": {"x": 1}, "c": [{"x": 1}, {"x": 1}]}


def test_a_recursive_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("a: &a [1, *a]\n")
    assert _message(read_yaml, str(path)) == f"{path}: the YAML has a recursive alias (*a inside &a)"


def test_an_alias_bomb_in_an_override_is_refused():
    text = "[" + ", ".join(["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
        f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]) + "]"
    msg = _message(parse_value, text)
    assert f"expands to more than {MAX_CONFIG_NODES} values" in msg, msg


def test_deep_nesting_is_refused_not_a_recursion_traceback(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    msg = _message(read_yaml, str(path))
    assert msg.startswith(f"{path}: the YAML nests deeper than"), msg


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_is_not_a_config_file(device):
    assert _message(load_config, device) == (
        f"{device}: not a regular file (a device, pipe or socket); a config is a YAML file")


def test_a_config_over_the_size_limit_is_refused_without_reading_it_all(tmp_path):
    path = tmp_path / "big.yaml"
    with open(path, "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)  # sparse: reading it all would be the bug
    assert _message(load_config, path) == (
        f"{path}: {MAX_CONFIG_BYTES + 1} bytes, over the {MAX_CONFIG_BYTES} bytes a config may have")


def test_the_cli_names_dev_zero_in_one_line_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "entr_megatron.cli.main", "train", "--config", "/dev/zero",
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "/dev/zero: not a regular file" in proc.stderr


# --- the planner -----------------------------------------------------------------------------


def _plan(tmp_path, workload=None, **costs):
    from entr_megatron.cli.main import main

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"costs": {**COSTS, **costs}, **({"workload": workload} if workload else {})}))
    with pytest.raises(SystemExit) as e:
        main(["plan", str(path), "--modes", "sync"])
    return e.value.code, path


@pytest.mark.parametrize("workload, field, rule", [
    ({"prompts_per_step": 100_000_000}, "prompts_per_step", "must be an integer in [1, 65536]"),
    ({"steps": 1_000_000_000}, "steps", "must be an integer in [1, 100000]"),
    ({"n": 5000}, "n", "must be an integer in [1, 1024]"),
    ({"steps": 1000, "prompts_per_step": 1000, "n": 8}, "steps",
     "steps x prompts_per_step x n = 8000000 sequences; must be at most 1000000 (the planner simulates each)"),
], ids=["prompts_per_step", "steps", "n", "product"])
def test_a_workload_too_large_to_simulate_is_refused_naming_the_field(tmp_path, capsys, workload, field, rule):
    code, path = _plan(tmp_path, workload)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"workload.{field}=" in err and rule in err, err


@pytest.mark.parametrize("costs, field, rule", [
    ({"response_sigma": 1000}, "response_sigma", "must be a number in [0, 10]"),
    ({"engines": 10**6}, "engines", "must be an integer in [1, 4096]"),
    ({"max_new_tokens": 10**9}, "max_new_tokens", "must be an integer in [1, 1048576]"),
], ids=["response_sigma", "engines", "max_new_tokens"])
def test_costs_out_of_range_are_refused_not_a_traceback(tmp_path, capsys, costs, field, rule):
    code, _ = _plan(tmp_path, None, **costs)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"costs.{field}=" in err and rule in err, err


def test_the_largest_sigma_allowed_simulates():
    from entr_megatron.study.planner import Costs, Workload, simulate

    plan = simulate(Costs(**COSTS, response_sigma=10.0), Workload(steps=3), "sync")
    assert len(plan.step_s) == 3 and plan.response_tokens > 0


def test_fixed_lag_lags_do_not_cost_a_loop_per_token():
    """The lag histogram of fixed_lag counts each segment of a response at once: the long
    responses the bounds allow take no longer than short ones."""
    from entr_megatron.study.planner import Costs, Workload, simulate

    costs = Costs(**COSTS, max_new_tokens=1_048_576, response_median=1_000_000, max_batch_size=1)
    t0 = time.monotonic()
    plan = simulate(costs, Workload(steps=2, prompts_per_step=4, n=2, inter_lag=3, intra_lag=2), "fixed_lag")
    assert time.monotonic() - t0 < 5.0
    assert sum(plan.lag_tokens.values()) == plan.response_tokens
    assert set(plan.lag_tokens) <= {0, 1, 2, 3, 4, 5}


def test_plan_at_the_bounds_ends_promptly_on_ctrl_c(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"costs": {**COSTS, "max_new_tokens": 4096, "response_median": 2000},
                                    "workload": {"steps": 100, "prompts_per_step": 1250, "n": 8}}))
    proc = subprocess.Popen([sys.executable, "-m", "entr_megatron.cli.main", "plan", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    try:
        time.sleep(8)  # well into the simulation
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and took < 5.0, (proc.returncode, took, err[-2000:])
    assert err.strip().splitlines()[-1] == "entr-megatron plan: interrupted", err[-2000:]


# --- learner ranks against the cores ---------------------------------------------------------


def test_more_cpu_learner_ranks_than_cores_are_refused_before_anything_starts(tmp_path, capsys):
    from entr_megatron.cli.main import main

    cores = len(os.sched_getaffinity(0))
    assert 64 > 4 * cores, "this test needs fewer than 16 cores"
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(DEMO), "--run-dir", str(tmp_path / "run"), "launcher.nproc_per_node=64"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert (f"launcher.nproc_per_node=64 is not valid; CPU learner ranks share this machine's {cores} cores: "
            f"must be at most {4 * cores} (4 per core)") in err, err
    assert not (tmp_path / "run").exists()


SLOW_START = """
import sys, time
from entr_megatron.controller.ranks.workers import ProcessWorkerGroup

def slow_factory():
    time.sleep(60)

if __name__ == "__main__":
    try:
        group = ProcessWorkerGroup(6, slow_factory, startup_timeout_s=120, wait=False)
        print("spawned", flush=True)
        group.wait_ready()
    except KeyboardInterrupt:
        print("driver: interrupted", file=sys.stderr)
        sys.exit(130)
"""


def test_ctrl_c_while_ranks_start_ends_the_group_at_once_without_a_traceback_per_rank(tmp_path):
    """Ctrl-C reaches the terminal's whole process group: ranks still importing (before they
    ignore SIGINT) printed a KeyboardInterrupt traceback each. They start with SIGINT held."""
    script = tmp_path / "driver.py"
    script.write_text(SLOW_START)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=ROOT, preexec_fn=sigint_default)
    try:
        assert proc.stdout.readline() == "spawned\n"
        time.sleep(0.5)  # the ranks are importing this module, torch with it (6 ranks on a few cores)
        assert proc.poll() is None
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and took < 15, (proc.returncode, took, err[-3000:])
    assert "Traceback" not in err and err.strip().splitlines() == ["driver: interrupted"], err[-3000:]


GLOO_START = """
import sys, time
from entr_megatron.utils.spawn import run_gloo

def work(rank, world_size):
    time.sleep(60)

if __name__ == "__main__":
    try:
        print("spawning", flush=True)
        run_gloo(work, 6, timeout_s=120)
    except KeyboardInterrupt:
        print("driver: interrupted", file=sys.stderr)
        sys.exit(130)
"""


def test_ctrl_c_while_scores_ranks_start_is_one_line(tmp_path):
    """`score` (and the tests' gloo helpers) start their ranks with run_gloo: quiet on Ctrl-C too."""
    script = tmp_path / "driver.py"
    script.write_text(GLOO_START)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=ROOT, preexec_fn=sigint_default)
    try:
        assert proc.stdout.readline() == "spawning\n"
        time.sleep(1.0)  # the ranks are spawned and importing this module, torch with it
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and took < 15, (proc.returncode, took, err[-3000:])
    assert "Traceback" not in err and err.strip().splitlines() == ["driver: interrupted"], err[-3000:]


def test_a_device_as_a_data_file_is_refused_before_it_is_read(tmp_path, capsys):
    """Data files have the config's regular-file check: /dev/zero as a task's or score's input was
    read as one endless line."""
    from entr_megatron.cli.main import main
    from entr_megatron.cli.sequence_scoring import read_input

    zero = tmp_path / "zero.jsonl"
    zero.symlink_to("/dev/zero")
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(DEMO), "--run-dir", str(tmp_path / "run"), "task.name=math",
              f"task.math.train_files=[{zero}]", f"model.tokenizer={tmp_path / 'tok'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert (f"task.math.train_files=('{zero}',) is not valid; {zero} is not a regular file (a device, pipe "
            "or socket)") in err, err
    with pytest.raises(ValueError) as e:
        read_input(str(zero), 100)
    assert str(e.value) == f"--input: {zero} is not a regular file (a device, pipe or socket); give a JSONL file"
