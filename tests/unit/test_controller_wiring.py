"""The job's pieces without processes: the task registry, the learner/pusher roles over a worker
group, the SGLang version view, the seeds of evaluation and SFT, the run directory's files."""

from __future__ import annotations

import json

import pytest

from entr_megatron.config.loader import load_config
from entr_megatron.controller.job.sglang_setup import PushedVersionView
from entr_megatron.controller.ranks.learner_worker import LearnerWorker
from entr_megatron.controller.ranks.remote import RemoteLearner, RemotePusher

from controller_fakes import OneTokenEngine


class FakeGroup:
    """A worker group of two learner ranks: records every call; rank 0 is the weight sender."""

    def __init__(self):
        self.calls = []

    def call(self, method, *args, **kwargs):
        self.calls.append((method, args, kwargs))
        if method.__name__ == "push":
            return [0.25, 0.5]
        if method.__name__ == "wait_push":
            return [{"sender": 1.0, "transfer_s": 2.0, "gbytes_per_s": 3.0}, {}]
        return [(method.__name__, "rank0"), (method.__name__, "rank1")]

    def raise_if_dead(self, what, grace_s=1.0):
        pass  # its ranks never die


def test_task_registry_is_exactly_the_configs_task_names(tok):
    from entr_megatron.config.task import TASK_NAMES
    from entr_megatron.controller.job.run import build_task
    from entr_megatron.tasks import TASK_BUILDERS, ArithmeticTask

    assert set(TASK_BUILDERS) == set(TASK_NAMES)
    cfg = load_config(None, ["task.arithmetic.digits=3", "task.arithmetic.reverse_answer=true"])
    task = build_task(cfg, tok)
    assert isinstance(task, ArithmeticTask) and task.digits == 3 and task.reverse_answer and task.tokenizer is tok
    with pytest.raises(ValueError, match=r"task\.name='chess'.*allowed: arithmetic, math, calculator, search"):
        load_config(None, ["task.name=chess"])
    # the multi-turn tasks: their episodes fit the sequence length, tool outputs included
    with pytest.raises(ValueError, match=r"model\.max_seq_len=2048.*max_response_tokens = 2560"):
        load_config(None, ["task.name=search", "rollout.agent.max_response_tokens=2048"])
    with pytest.raises(ValueError, match=r"rollout\.agent\.max_response_tokens=64.*>= rollout\.sampling\.max_new_tokens=128"):
        load_config(None, ["task.name=calculator", "rollout.agent.max_response_tokens=64"])


def test_learner_role_is_rank_zeros_answer():
    group = FakeGroup()
    learner = RemoteLearner(group)
    assert learner.train("batch", 3) == ("train", "rank0")
    assert learner.save("/ckpt", 5, {"controller": {}}, 2) == ("save", "rank0")
    assert learner.load("/ckpt") == ("load", "rank0")
    assert learner.load("/ckpt", 7, verify=False) == ("load", "rank0")
    assert learner.export_hf("/out") == ("export_hf", "rank0")
    W = LearnerWorker
    assert group.calls == [(W.train, ("batch", 3), {}), (W.save, ("/ckpt", 5, {"controller": {}}, 2), {}),
                           (W.load, ("/ckpt", None, True), {}), (W.load, ("/ckpt", 7, False), {}),
                           (W.export_hf, ("/out",), {})]


def test_pusher_role_feeds_each_engine_its_receiver_and_reports():
    group, engines = FakeGroup(), [OneTokenEngine(), OneTokenEngine()]
    pusher = RemotePusher(group, engines, ["recv0", "recv1"])
    handle = pusher.push(4)
    report = handle.wait()
    assert [e.updates for e in engines] == [[("recv0", 4)], [("recv1", 4)]]
    assert report["weight_sync/version"] == 4.0 and report["weight_sync/learner_blocked_s"] == 0.5
    assert report["weight_sync/transfer_s"] == 2.0 and report["weight_sync/gbytes_per_s"] == 3.0
    assert report["weight_sync/engine_blocked_s"] == 0.01
    assert pusher.last_push_report is report and handle.wait() is report
    with pytest.raises(ValueError, match="one receiver per engine"):
        RemotePusher(group, engines, ["recv0"])


def test_sglang_view_takes_its_version_from_delivered_pushes():
    engine = OneTokenEngine(version=5)  # the controller's client: never updates the servers itself
    view = PushedVersionView(engine)
    pusher = RemotePusher(FakeGroup(), on_delivered=view.confirm_version)
    assert view.weight_version == 5  # before any push: what the servers said
    handle = pusher.push(7)
    assert view.weight_version == 5, "a push in flight is not delivered yet"
    handle.wait()
    assert view.weight_version == 7 and view.health().weight_version == 7 and engine.version == 5
    view.confirm_version(6)  # versions never go back
    assert view.weight_version == 7
    from entr_megatron.rollout.engine import GenerateRequest, SamplingParams

    [rid] = view.submit([GenerateRequest([1, 2], SamplingParams(max_new_tokens=1))])
    assert [r.request_id for r in view.poll()] == [rid] and engine.requests


def test_evaluation_and_sft_seeds_are_mixed_from_the_run_seed(tok):
    from entr_megatron.controller.job.evaluation import evaluate
    from entr_megatron.controller.job.run import build_task
    from entr_megatron.controller.job.sft import sft_examples

    cfg = load_config(None, ["controller.seed=3", "task.arithmetic.digits=1"])
    task = build_task(cfg, tok)
    engine = OneTokenEngine()
    metrics = evaluate(engine, task, 5, cfg.rollout.sampling, seed=3)
    assert metrics["eval/num_problems"] == 5.0
    seeds = [r.params.seed for r in engine.requests]
    assert seeds == [3 * 1_000_003 + i for i in range(5)] * 2  # greedy, then sampled
    prompts = [r.prompt_ids for r in engine.requests[:5]]
    assert prompts == [ids for ids, _ in task.prompts("test", 5, seed=3)]
    engine = OneTokenEngine()
    evaluate(engine, task, 5, cfg.rollout.sampling, seed=3, split="train")  # `eval --split train`
    assert [r.prompt_ids for r in engine.requests[:5]] == [ids for ids, _ in task.prompts("train", 5, seed=3)]

    drawn = []

    class Recording:
        name, tokenizer = "recording", tok

        def sft_examples(self, split, n, seed):
            drawn.append((split, n, seed))
            return []

    cfg = load_config(None, ["controller.seed=3", "sft.batch_size=2"])
    sft_examples(cfg, Recording(), step=4)
    assert drawn == [("train", 2, 3 * 1_000_003 + 4 + 7_919)]


def test_run_dir_files(tmp_path):
    from entr_megatron.controller.job.run_dir import RunPaths, export_final_model, read_eval, save_eval, write_config

    paths = RunPaths(tmp_path / "run")
    write_config(load_config(None, []), paths)
    write_config(load_config(None, []), paths)
    assert paths.config.exists() and not paths.config.with_suffix(".yaml.previous").exists()
    write_config(load_config(None, ["controller.seed=9"]), paths)
    assert paths.config.with_suffix(".yaml.previous").exists()

    assert read_eval(paths, "before_rl") is None
    save_eval(paths, "before_rl", {"eval/accuracy": 0.5})
    save_eval(paths, "after_rl", {"eval/accuracy": 0.75})
    assert json.loads(paths.eval.read_text()) == {"before_rl": {"eval/accuracy": 0.5}, "after_rl": {"eval/accuracy": 0.75}}
    assert read_eval(paths, "before_rl") == {"eval/accuracy": 0.5}

    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text("{}")

    class Exporter:
        def export_hf(self, out):
            (tmp_path / "run" / "final_model").mkdir()
            (tmp_path / "run" / "final_model" / "config.json").write_text("{}")

    assert paths.latest_model() is None
    export_final_model(Exporter(), paths, tokenizer_dir)
    assert (paths.final_model / "tokenizer.json").exists() and paths.latest_model() == paths.final_model
    export_final_model(Exporter(), paths, tokenizer_dir)  # an earlier end of the run is kept aside
    assert (paths.root / "final_model.previous" / "config.json").exists()


def test_engine_configs_read_their_rollout_section():
    """Each engine reads its own section; the per-engine defaults of kv_on_update differ."""
    from entr_megatron.config import EmbeddedConfig, RolloutConfig, SGLangConfig
    from entr_megatron.rollout.embedded import EmbeddedEngineConfig
    from entr_megatron.rollout.sglang import SGLangEngineConfig

    r = RolloutConfig(dtype="bfloat16", weight_bucket_mib=3,
                      embedded=EmbeddedConfig(max_batch_size=5, max_prefill_tokens=77, num_threads=2))
    e = EmbeddedEngineConfig.from_config(r, model_dir="/m", max_model_len=40, seed=9)
    assert (e.model_dir, e.dtype, e.init, e.seed, e.max_model_len) == ("/m", "bfloat16", "pretrained", 9, 40)
    assert (e.max_batch_size, e.max_prefill_tokens, e.num_threads, e.kv_on_update) == (5, 77, 2, "keep")
    s = RolloutConfig(engine="sglang", dtype="auto", weight_bucket_mib=3, kv_on_update="keep",
                      sglang=SGLangConfig(max_concurrent_requests=7))
    g = SGLangEngineConfig.from_config(s, ["http://a:1", "http://b:2"], tp_sizes=(2, 2), weight_dtype="bfloat16")
    assert g.urls == ("http://a:1", "http://b:2") and g.tp_sizes == (2, 2) and g.weight_dtype == "bfloat16"
    assert (g.max_concurrent_requests, g.weight_bucket_bytes, g.kv_on_update) == (14, 3 << 20, "keep")
    assert SGLangEngineConfig.from_config(RolloutConfig(engine="sglang", dtype="auto"), ["http://a:1"]).kv_on_update == "recompute"
