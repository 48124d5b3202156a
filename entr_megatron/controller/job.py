"""The main job: prepare the model, SFT warm-up, asynchronous RL, evaluation; resumable.

    run_dir/
      config.yaml           the resolved config of the latest start
      model_init/           HF model + tokenizer built from `model.architecture` (random, seeded)
      sft/model/            HF model after the supervised warm-up (its presence means "done")
      sft/metrics.jsonl
      checkpoints/          Megatron dist checkpoints (model, optimizer, scheduler, RNG, controller state)
      metrics.jsonl         one JSON object per RL step;  tensorboard/
      eval.json             held-out accuracy before and after RL
      final_model/          HF export of the last step

`train` resumes where the run stopped: SFT is skipped when `sft/model` exists,
RL continues from the latest checkpoint (weights, optimizer, data position,
staleness buffer, RNG); metrics.jsonl drops the lines of steps that are redone.
Ctrl-C finishes the current step, saves a checkpoint and exits; a second Ctrl-C
stops at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from entr_megatron.config.loader import dump_config
from entr_megatron.config.run import RunConfig
from entr_megatron.controller.learner_worker import LearnerWorkerSpec, make_learner_worker
from entr_megatron.controller.loop import Controller, ControllerHooks, ControllerOptions
from entr_megatron.controller.remote import RemoteLearner
from entr_megatron.controller.sglang_setup import SGLangPusher, check_launch, forget_server_versions, sglang_engine
from entr_megatron.controller.workers import ProcessWorkerGroup, RayWorkerGroup
from entr_megatron.rollout.engine import GenerateRequest, RolloutEngine, SamplingParams, generate
from entr_megatron.types import Sample, TrainBatch
from entr_megatron.utils.run_log import MetricsLogger, ProgressBar
from entr_megatron.utils.spawn import free_port_range

__all__ = ["RunPaths", "build_task", "check_launch", "evaluate", "prepare_model", "run_sft", "run_train"]

log = logging.getLogger("entr_megatron")


@dataclasses.dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def model_init(self) -> Path:
        return self.root / "model_init"

    @property
    def sft_model(self) -> Path:
        return self.root / "sft" / "model"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def eval(self) -> Path:
        return self.root / "eval.json"

    @property
    def final_model(self) -> Path:
        return self.root / "final_model"


def _say(msg: str) -> None:
    print(f"[entr-megatron] {msg}", file=sys.stderr, flush=True)


# --- model and task -----------------------------------------------------------------------------

def tokenizer_for(cfg: RunConfig) -> Any:
    from entr_megatron.rollout.tasks import build_char_tokenizer, load_tokenizer

    source = cfg.model.tokenizer or cfg.model.path
    if source:
        return load_tokenizer(source)
    if cfg.task.name in ("arithmetic", "calculator"):
        return build_char_tokenizer()
    raise ValueError(f"task.name={cfg.task.name!r} needs a tokenizer: set model.path or model.tokenizer")


def build_task(cfg: RunConfig, tokenizer: Any) -> Any:
    """The task of `cfg.task` with the policy's tokenizer."""
    from entr_megatron.rollout.tasks import ArithmeticTask, MathTask

    t = cfg.task
    if t.name == "arithmetic":
        a = t.arithmetic
        return ArithmeticTask(a.digits, a.operations, tokenizer=tokenizer, reverse_answer=a.reverse_answer,
                              pad_operands=a.pad_operands, format_reward=a.format_reward)
    if t.name == "math":
        files = {"train": list(t.math.train_files)}
        if t.math.eval_files:
            files["test"] = list(t.math.eval_files)
        return MathTask(tokenizer, files)
    raise ValueError(f"task.name={t.name!r}: the training loop runs single-turn tasks ('arithmetic', 'math'); "
                     "the multi-turn calculator runs through rollout.tasks.run_episodes")


def prepare_model(cfg: RunConfig, paths: RunPaths, tokenizer: Any) -> Path:
    """The HF directory the run starts from: `model.path`, or a model built from
    `model.architecture` (random weights seeded by controller.seed, the tokenizer beside it)."""
    if cfg.model.path:
        return Path(cfg.model.path)
    out = paths.model_init
    if (out / "config.json").exists():
        return out
    import transformers

    arch = dict(cfg.model.architecture)
    model_type = arch.pop("model_type")
    # A model's vocabulary may be larger than its tokenizer's (Qwen: 151936 rows, 151665 tokens).
    vocab_size = arch.pop("vocab_size", len(tokenizer))
    if not isinstance(vocab_size, int) or vocab_size < len(tokenizer):
        raise ValueError(f"model.architecture.vocab_size={vocab_size!r} is not valid; must be an integer >= the "
                         f"tokenizer's {len(tokenizer)} tokens (or left out to take exactly those)")
    hf_config = transformers.AutoConfig.for_model(
        model_type, **arch, vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.controller.seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    _say(f"built {model_type} model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
         f"vocab {len(tokenizer)}) in {out}")
    return out


# --- processes ----------------------------------------------------------------------------------

def _learner_group(cfg: RunConfig, model_dir: Path, phase: str):
    spec = LearnerWorkerSpec(cfg, str(model_dir), phase)
    launcher = cfg.launcher
    world = launcher.world_size
    threads = launcher.cpu_threads_per_rank
    if phase == "sft" and launcher.device == "cpu" and launcher.kind == "local":
        threads = max(threads or 1, (os.cpu_count() or 1) // world)  # no engine runs beside the warm-up
    if launcher.kind == "ray":
        gpus = 1.0 if launcher.device == "cuda" else 0.0
        return RayWorkerGroup(world, make_learner_worker, (spec,), threads_per_rank=threads, gpus_per_rank=gpus,
                              ray_address=launcher.ray_address)
    return ProcessWorkerGroup(world, make_learner_worker, (spec,), threads_per_rank=threads,
                              master_addr=launcher.master_addr)


def make_engines(cfg: RunConfig, model_dir: Path, stack: ExitStack, log_dir: Path | None = None) -> list[RolloutEngine]:
    """The run's engines, their shutdown (and that of servers launched here) on `stack`.
    SGLang: one `SGLangEngine` over every server (it balances the requests itself)."""
    r = cfg.rollout
    if r.engine == "sglang":
        return [sglang_engine(cfg, model_dir, stack, log_dir)]
    from entr_megatron.rollout.embedded import EmbeddedEngine, EmbeddedEngineConfig

    on_ray = cfg.launcher.kind == "ray"
    if on_ray:
        _ray_init(cfg)
        from entr_megatron.controller.ray_engine import RayEngine
    engines = []
    for i in range(r.num_engines):
        config = EmbeddedEngineConfig(
            model_dir=str(model_dir), dtype=r.dtype, init="pretrained", seed=cfg.controller.seed + i,
            max_batch_size=r.embedded.max_batch_size, max_prefill_tokens=r.embedded.max_prefill_tokens,
            max_model_len=cfg.model.max_seq_len, kv_on_update=r.kv_on_update or "keep",
            num_threads=r.embedded.num_threads,
        )
        engine = RayEngine(config, num_cpus=r.embedded.num_threads or 1) if on_ray else EmbeddedEngine(config)
        stack.callback(engine.shutdown)
        engines.append(engine)
    return engines


def _ray_init(cfg: RunConfig) -> None:
    try:
        import ray
    except ImportError as e:
        raise ImportError("launcher.kind='ray' needs Ray: pip install 'entr-megatron[cluster]'") from e
    if not ray.is_initialized():
        ray.init(address=cfg.launcher.ray_address, include_dashboard=False)


def _as_one_engine(engines: list[RolloutEngine]) -> RolloutEngine:
    if len(engines) == 1:
        return engines[0]
    from entr_megatron.controller.engines import EngineSet

    return EngineSet(engines)


class _StopFlag:
    """SIGINT sets the flag (the loop saves and exits after the step); a second SIGINT raises."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        _say("Ctrl-C: finishing this step, saving a checkpoint, then exiting (Ctrl-C again to stop now)")

    def __call__(self) -> bool:
        return self.requested

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)


# --- evaluation ---------------------------------------------------------------------------------

def evaluate(engine: RolloutEngine, task: Any, n: int, sampling: Any, seed: int = 0,
             samples_per_problem: int = 4) -> dict[str, float]:
    """Held-out accuracy on `n` problems of the test split: greedy (`eval/accuracy`), and the
    mean over `samples_per_problem` samples drawn as in training (`sampling`: the config's
    temperature, top-p, top-k), i.e. the accuracy of the policy RL optimises
    (`eval/sampled_accuracy`). A sample is correct when its reward is 1."""
    pairs = task.prompts("test", n, seed=seed)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=sampling.max_new_tokens, n=1)
    sampled = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                             max_new_tokens=sampling.max_new_tokens, n=samples_per_problem)
    out: dict[str, float] = {"eval/num_problems": float(len(pairs))}
    for name, params in (("accuracy", greedy), ("sampled_accuracy", sampled)):
        requests = [GenerateRequest(ids, dataclasses.replace(params, seed=seed * 1_000_003 + i))
                    for i, (ids, _) in enumerate(pairs)]
        results = generate(engine, requests, timeout_s=3600)
        refs = [ref for _, ref in pairs for _ in range(params.n)]
        rewards = [float(task.reward(r.to_sample(), ref)) for r, ref in zip(results, refs)]
        out[f"eval/{name}"] = sum(r == 1.0 for r in rewards) / len(rewards)
    return out


# --- SFT ----------------------------------------------------------------------------------------

def _sft_examples(cfg: RunConfig, task: Any, step: int) -> list[tuple[list[int], list[int]]]:
    from entr_megatron.controller.sft_data import load_sft_file_examples

    n = cfg.sft.batch_size
    if cfg.sft.data_files:
        return load_sft_file_examples(cfg.sft.data_files, task.tokenizer, n, step, seed=cfg.controller.seed)
    if not hasattr(task, "sft_examples"):
        raise ValueError(f"task {task.name!r} generates no SFT data: set sft.data_files")
    return task.sft_examples("train", n, seed=cfg.controller.seed * 1_000_003 + step + 7_919)


def sft_batch(examples: list[tuple[list[int], list[int]]]) -> TrainBatch:
    """Target tokens as responses (behaviour log-probs unused by the NLL loss)."""
    samples = [Sample(prompt_ids=list(p), response_ids=list(t), behaviour_logprobs=[0.0] * len(t),
                      versions=[0] * len(t), group_id=i, finish_reason="stop")
               for i, (p, t) in enumerate(examples)]
    return TrainBatch.from_samples(samples, torch.zeros(len(samples)))


def _copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files next to an exported model (the export writes config and weights only)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists() and not (dst / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())


def run_sft(cfg: RunConfig, paths: RunPaths, model_dir: Path, task: Any, steps: int | None = None) -> Path:
    """The supervised warm-up on the learner (Megatron, NLL of the targets); writes `sft/model`."""
    if cfg.sft is None:
        raise ValueError("the config has no `sft` section")
    steps = cfg.sft.steps if steps is None else steps
    out = paths.sft_model
    if out.exists():
        _say(f"SFT already done: {out}")
        return out
    _say(f"SFT warm-up: {steps} steps x {cfg.sft.batch_size} examples, lr {cfg.sft.lr:g}")
    group = _learner_group(cfg, model_dir, "sft")
    try:
        with MetricsLogger(out.parent, tensorboard=False, resume_from_step=0) as logger:
            bar = ProgressBar(steps, desc="sft", enabled=cfg.logging.progress_bar,
                              log_interval=max(cfg.logging.log_interval, 10))
            for step in range(steps):
                t0 = time.perf_counter()
                batch = sft_batch(_sft_examples(cfg, task, step))
                metrics = group.call("train", batch, 0)[0]
                row = {"step": step, "sft/nll": metrics.get("loss", float("nan")),
                       "grad_norm": metrics.get("grad_norm", float("nan")),
                       "throughput/tokens_per_s": float(batch.cu_seqlens[-1]) / (time.perf_counter() - t0)}
                logger.log(row)
                bar.update({**row, "step": step + 1})
            bar.close()
        group.call("export_hf", str(out))
    finally:
        group.shutdown()
    _copy_tokenizer(model_dir, out)
    _say(f"SFT done: {out}")
    return out


# --- RL -----------------------------------------------------------------------------------------

def _start_model(cfg: RunConfig, paths: RunPaths, tokenizer: Any, task: Any) -> Path:
    model_dir = prepare_model(cfg, paths, tokenizer)
    if cfg.sft is not None and cfg.sft.steps > 0:
        return run_sft(cfg, paths, model_dir, task)
    return model_dir


def _write_config(cfg: RunConfig, paths: RunPaths) -> None:
    paths.root.mkdir(parents=True, exist_ok=True)
    text = dump_config(cfg)
    if paths.config.exists() and paths.config.read_text() != text:
        _say(f"the config differs from the one {paths.config} was started with; keeping the old one as "
             f"{paths.config.name}.previous")
        os.replace(paths.config, paths.config.with_suffix(".yaml.previous"))
    tmp = paths.config.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, paths.config)


def _save_eval(paths: RunPaths, key: str, metrics: dict) -> None:
    data = json.loads(paths.eval.read_text()) if paths.eval.exists() else {}
    data[key] = metrics
    tmp = paths.eval.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, paths.eval)


def run_train(cfg: RunConfig, run_dir: str | os.PathLike | None = None, max_steps: int | None = None) -> dict:
    """SFT (once), then RL until `controller.train_steps` (or `max_steps` more this start);
    returns {"steps": ..., "eval_before": ..., "eval_after": ...}."""
    from entr_megatron.learner.checkpoint_dir import latest_step
    from entr_megatron.weight_sync import receiver_for, stage_groups

    paths = RunPaths(Path(run_dir or cfg.logging.run_dir))
    check_launch(cfg)  # before anything is written
    _write_config(cfg, paths)
    tokenizer = tokenizer_for(cfg)
    task = build_task(cfg, tokenizer)
    start_dir = _start_model(cfg, paths, tokenizer, task)
    resume_step = latest_step(paths.checkpoints) if paths.checkpoints.exists() else None
    c = cfg.controller
    done = resume_step or 0
    remaining = c.train_steps - done
    if max_steps is not None:
        remaining = min(remaining, max_steps)
    out: dict[str, Any] = {"start_step": done}
    with ExitStack() as stack:
        _say(f"starting {cfg.rollout.num_engines} {cfg.rollout.engine} engine(s) and "
             f"{cfg.launcher.world_size} learner rank(s) ({cfg.launcher.kind})")
        sglang = cfg.rollout.engine == "sglang"
        if sglang:
            forget_server_versions(cfg)
        engines = make_engines(cfg, start_dir, stack, paths.root / "sglang")
        engine = _as_one_engine(engines)
        group = _learner_group(cfg, start_dir, "rl")
        stack.callback(group.shutdown)
        # One broadcast group per pipeline stage, hosted where learner rank 0 runs (single-node
        # stages; a multi-node PP>1 layout would need each stage sender's address).
        address = group.call("master_address")[0]
        base_port = free_port_range(cfg.parallel.pp)  # stage p on base_port + p
        bucket = (cfg.rollout.weight_bucket_mib or 512) << 20
        if sglang:  # rank 0 updates the servers itself (SGLangTransport); see sglang_setup.py
            group.call("connect_weight_sync", address, base_port, (), bucket, None, sglang=engine.config,
                       snapshot=cfg.rollout.weight_snapshot)
            learner = SGLangPusher(group, engine)
        else:
            wgroups = stage_groups(address, base_port, pp_size=cfg.parallel.pp, engine_ranks=(1,) * len(engines))
            wire_dtype = None if cfg.rollout.dtype == cfg.model.dtype else cfg.rollout.dtype
            group.call("connect_weight_sync", address, base_port, (1,) * len(engines), bucket, wire_dtype,
                       snapshot=cfg.rollout.weight_snapshot)
            learner = RemoteLearner(group, engines, [receiver_for(wgroups, i) for i in range(len(engines))])
        if resume_step is None and engine.weight_version != 0:  # servers given by URL: the learner's weights
            _say("pushing the learner's weights to the engines (version 0)")
            learner.push(0).wait()

        evals = cfg.task.eval_size > 0  # task.eval_size 0: no held-out evaluation at all
        if evals and resume_step is None and not paths.eval.exists():
            before = evaluate(engine, task, cfg.task.eval_size, cfg.rollout.sampling, c.seed)
            _save_eval(paths, "before_rl", before)
            _say(f"held-out accuracy before RL: greedy {before['eval/accuracy']:.3f}, sampled "
                 f"{before['eval/sampled_accuracy']:.3f} ({int(before['eval/num_problems'])} problems)")
        out["eval_before"] = json.loads(paths.eval.read_text()).get("before_rl") if paths.eval.exists() else None

        controller = Controller(engine, learner, learner, task, ControllerOptions.from_config(cfg),
                                advantage_fn=cfg.algorithm.advantage_estimator)
        if resume_step is not None:
            step, extra = group.call("load", str(paths.checkpoints))[0]
            controller.load_state_dict(extra["controller"])
            _say(f"resumed from step {step} ({paths.checkpoints})")
        logger = stack.enter_context(MetricsLogger(paths.root, tensorboard=cfg.logging.tensorboard,
                                                   resume_from_step=done))
        bar = ProgressBar(c.train_steps, initial=done, desc=f"rl {c.mode}", enabled=cfg.logging.progress_bar,
                          log_interval=cfg.logging.log_interval)
        stack.callback(bar.close)

        def on_step(metrics: dict) -> None:
            metrics.update(learner.last_push_report)
            logger.log(metrics)
            bar.update({**metrics, "step": metrics["step"] + 1})

        def on_checkpoint(ctl: Controller) -> None:
            t0 = time.perf_counter()
            group.call("save", str(paths.checkpoints), ctl.step, {"controller": ctl.state_dict()},
                       c.keep_last_checkpoints)
            _say(f"checkpoint at step {ctl.step} ({time.perf_counter() - t0:.1f} s)")

        def on_eval(ctl: Controller) -> dict:
            return evaluate(engine, task, cfg.task.eval_size, cfg.rollout.sampling, c.seed) if evals else {}

        stop = stack.enter_context(_StopFlag())
        controller.hooks = ControllerHooks(on_step=[on_step], checkpoint_interval=c.checkpoint_interval,
                                           on_checkpoint=on_checkpoint, eval_interval=c.eval_interval,
                                           on_eval=on_eval, should_stop=stop)
        t0 = time.perf_counter()
        history = controller.run(max(remaining, 0)) if remaining > 0 else []
        wall = time.perf_counter() - t0
        out["steps"], out["wall_s"] = len(history), wall
        out["step_s_mean"] = wall / len(history) if history else None
        finished = controller.step >= c.train_steps
        if history and not stop() and (not c.checkpoint_interval or controller.step % c.checkpoint_interval):
            controller.drain()
            on_checkpoint(controller)
        if finished and not stop():
            controller.drain()
            after = evaluate(engine, task, cfg.task.eval_size, cfg.rollout.sampling, c.seed) if evals else None
            if after is not None:
                _save_eval(paths, "after_rl", after)
            out["eval_after"] = after
            if paths.final_model.exists():  # an earlier end of this run (train_steps since raised)
                previous = paths.final_model.with_name(paths.final_model.name + ".previous")
                if previous.exists():
                    shutil.rmtree(previous)
                os.replace(paths.final_model, previous)
            group.call("export_hf", str(paths.final_model))
            _copy_tokenizer(start_dir, paths.final_model)
            before = out["eval_before"] or {}
            nan = float("nan")
            if after is not None:
                _say(f"held-out accuracy, {int(after['eval/num_problems'])} problems: greedy "
                     f"{before.get('eval/accuracy', nan):.3f} before RL -> {after['eval/accuracy']:.3f} after; "
                     f"sampled as in training {before.get('eval/sampled_accuracy', nan):.3f} -> "
                     f"{after['eval/sampled_accuracy']:.3f}")
        out["stopped"] = stop()
        if stop():
            _say(f"stopped at step {controller.step} (checkpoint saved); run the same command to resume")
    return out
