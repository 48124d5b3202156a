"""A study spec: a base config, overrides, grid axes over any config field, seeds, and an
optional shared warm-up. Validated completely (every cell's config included) before anything runs.

    name: staleness                      # default: the file's stem
    base: ../../examples/study_base.yaml # a run config; relative paths are against the spec's folder
    overrides:                           # dotted keys, applied to every cell
      controller.mode: fixed_lag
      rollout.dtype: bfloat16
    grid:                                # one mapping: its full product; a list of mappings: the union
      algorithm.correction: [none, entr, icepop]
      controller.inter_lag: [0, 4, 16]
    seeds: [0, 1, 2]                     # controller.seed of each cell (default [0])
    warmup:                              # optional: one SFT run whose model every cell starts from
      overrides: {sft.steps: 250}        # on top of base + overrides (needs an `sft` section)
      # per_seed: true                   # or: one warm-up per seed (controller.seed = the seed), each
                                         # seed's cells start from their own (seeds then differ in
                                         # their warm-up too, so their spread includes it)
      # model: ../other/warmup/sft/model # or: reuse a finished warm-up (an HF model directory); with
                                         # `{seed}` in it, one per seed (../w/seed{seed}/sft/model)
    resources: {num_cpus: 2}             # per cell: Ray task resources (num_cpus, num_gpus)
    methods:                             # optional: named bundles of dotted overrides, gridded
      dppo: {algorithm.correction: none, algorithm.policy_loss: dppo_tv}   # as the axis `method`
      naive_entr: {algorithm.correction: naive, algorithm.add_entr_mask: true}
    report:                              # how `study report` groups the cells (all optional)
      method: algorithm.correction
      lag: controller.inter_lag
      reference: {controller.inter_lag: 0}

Each cell is an ordinary `train` run directory (see runner.py). Its id names its axis values,
e.g. ``correction=entr,inter_lag=4,seed=0`` (an axis is named by the last part of its key
unless two axes share it).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from entr_megatron.config.loader import config_as_dict, config_from_dict, dump_config, read_yaml, set_field
from entr_megatron.config.run import RunConfig

__all__ = ["Cell", "SpecError", "StudySpec", "flatten_config", "load_spec"]

SEED_KEY = "controller.seed"
SPEC_KEYS = ("name", "base", "overrides", "grid", "seeds", "warmup", "resources", "report", "methods")
METHOD_KEY = "method"
"""The grid axis whose values name entries of the spec's `methods`: each cell gets that entry's overrides."""
RESOURCE_KEYS = ("num_cpus", "num_gpus")
REPORT_KEYS = ("method", "lag", "reference")


class SpecError(ValueError):
    """A study spec that cannot run; the message names the spec file and the field."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the study: its axis values and its validated config (run_dir not yet set)."""

    id: str
    axes: dict[str, Any]
    raw: dict[str, Any]
    """The raw config mapping (base + overrides + axes), what `config` was validated from."""
    config: RunConfig

    def config_hash(self) -> str:
        """Identity of what the cell computes (its run directory excluded)."""
        return hashlib.sha256(dump_config(self._resolved()).encode()).hexdigest()[:16]

    def config_fields(self) -> dict[str, Any]:
        """Every field of the resolved config by dotted key (its run directory excluded)."""
        return flatten_config(config_as_dict(self._resolved()))

    def _resolved(self) -> RunConfig:
        return dataclasses.replace(self.config, logging=dataclasses.replace(self.config.logging, run_dir="."))


def flatten_config(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted key: value} (an empty section stays one key)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@dataclasses.dataclass(frozen=True)
class StudySpec:
    path: Path
    name: str
    base: Path
    base_raw: dict[str, Any]
    overrides: dict[str, Any]
    grids: list[dict[str, list[Any]]]
    seeds: list[int]
    warmup: dict[str, Any] | None
    resources: dict[str, float]
    report: dict[str, Any]
    methods: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Named bundles of dotted overrides (`method` axis values)."""

    @property
    def axes(self) -> list[str]:
        """Every grid key in spec order, then controller.seed."""
        keys: list[str] = []
        for grid in self.grids:
            keys += [k for k in grid if k not in keys]
        return keys + [SEED_KEY]

    def cell_axes(self) -> list[tuple[str, dict[str, Any]]]:
        """(id, axes) of every cell in run order, without building their configs (see `cells`)."""
        return [(cell_id, axes) for cell_id, axes, _ in self._grid_points()]

    def _grid_points(self) -> list[tuple[str, dict[str, Any], str]]:
        """(id, axes, where in the spec) of every cell, seed by seed; a cell two grids of the union
        share comes once."""
        points: dict[str, tuple[str, dict[str, Any], str]] = {}
        # seed-major: a study stopped part-way has every grid point of the first seeds
        for seed, (g, grid) in itertools.product(self.seeds, enumerate(self.grids)):
            where = "grid" if len(self.grids) == 1 else f"grid[{g}]"
            for values in itertools.product(*grid.values()):
                axes = {**dict(zip(grid, values)), SEED_KEY: seed}
                points.setdefault(self._cell_id(axes), (self._cell_id(axes), axes, where))
        return list(points.values())

    @property
    def per_seed_warmup(self) -> bool:
        """True when each seed has its own warm-up (`warmup.per_seed`)."""
        return bool(self.warmup and self.warmup.get("per_seed"))

    def warmup_models(self, seeds: Iterable[int] | None = None) -> Path | dict[int, Path]:
        """`warmup.model`: the finished warm-up every cell starts from, or with `{seed}` in its path
        {seed: that seed's}, each of `seeds` (None: every seed; the seeds of the cells `--only`
        chose) checked here, when the study runs (a tool may build them after the spec is written)."""
        model = self.warmup["model"]
        if isinstance(model, dict):
            wanted = model if seeds is None else {seed: model[seed] for seed in seeds}
            missing = [str(p) for p in wanted.values() if not (p / "config.json").is_file()]
            if missing:
                raise SpecError(f"{self.path}: warmup.model: {missing} have no config.json (HF model "
                                "directories): build each seed's warm-up first (the spec's header says how)")
        return model

    def cells(self, warmup_model: Path | Mapping[int, Path] | None = None) -> list[Cell]:
        """Every cell, validated, seed by seed (the order they run in); with `warmup_model` each
        starts from that model (no own SFT): one for all, or one per seed (a mapping seed -> model)."""
        out: dict[str, Cell] = {}
        for cell_id, axes, where in self._grid_points():
            model = warmup_model.get(axes[SEED_KEY]) if isinstance(warmup_model, Mapping) else warmup_model
            raw = self._raw(axes, where)
            wandb = raw.get("logging", {}).get("wandb")
            if isinstance(wandb, dict):  # the study's cells are one W&B group, each named by its id
                raw["logging"]["wandb"] = {"group": self.name, "name": cell_id, **{k: v for k, v in wandb.items()
                                                                                  if v is not None}}
            if model is not None:
                raw["model"] = {**raw.get("model", {}), "path": str(model), "architecture": None}
                raw.pop("sft", None)
            out[cell_id] = Cell(cell_id, axes, raw, self._validate(raw, f"{where} cell {cell_id}"))
        return list(out.values())

    def select(self, cells: list[Cell], only: list[str]) -> list[Cell]:
        """The cells matching every `AXIS=V1,V2,...` filter (an axis named by its dotted key or
        its last part, e.g. `inter_lag=0,16` or `seed=1`); values of one filter are alternatives."""
        chosen = cells
        for item in only:
            name, sep, values = item.partition("=")
            keys = [k for k in self.axes if name in (k, k.rsplit(".", 1)[-1])]
            if not sep or not values or len(keys) != 1:
                raise SpecError(f"--only {item!r}: expected AXIS=VALUE[,VALUE...] with AXIS one of "
                                f"{[k.rsplit('.', 1)[-1] for k in self.axes]} (or its dotted key)")
            key, wanted = keys[0], values.split(",")
            present = sorted({_token(c.axes[key]) for c in cells if key in c.axes})
            unknown = [v for v in wanted if v not in present]
            if unknown:
                raise SpecError(f"--only {item!r}: {key} has no value {unknown}; the study has {present}")
            chosen = [c for c in chosen if key in c.axes and _token(c.axes[key]) in wanted]
        return chosen

    def warmup_config(self, seed: int | None = None) -> dict[str, Any] | None:
        """The raw config of the shared SFT run (base + overrides + warmup.overrides); with
        `warmup.per_seed`, of seed `seed`'s (controller.seed set to it; default the first seed)."""
        if self.warmup is None or "model" in self.warmup:
            return None
        raw = copy.deepcopy(self.base_raw)
        for key, value in {**self.overrides, **self.warmup.get("overrides", {})}.items():
            _set(raw, key, value, self.path, "warmup.overrides" if key in self.warmup.get("overrides", {}) else "overrides")
        if self.per_seed_warmup:
            _set(raw, SEED_KEY, self.seeds[0] if seed is None else seed, self.path, "warmup.per_seed")
        if raw.get("sft") is None:
            raise SpecError(f"{self.path}: warmup: the base config (with overrides) has no `sft` section to run")
        self._validate(raw, "warmup")
        return raw

    def _raw(self, axes: Mapping[str, Any], where: str) -> dict[str, Any]:
        raw = copy.deepcopy(self.base_raw)
        for key, value in self.overrides.items():
            _set(raw, key, value, self.path, "overrides")
        for key, value in axes.items():
            if key == METHOD_KEY:  # a named bundle of overrides, applied where the axis stands
                for field, field_value in self.methods[value].items():
                    _set(raw, field, field_value, self.path, f"methods.{value}")
                continue
            _set(raw, key, value, self.path, where if key != SEED_KEY else "seeds")
        return raw

    def _validate(self, raw: dict[str, Any], what: str) -> RunConfig:
        try:
            return config_from_dict(raw)
        except ValueError as e:
            raise SpecError(f"{self.path}: {what}: {e}") from None

    def _cell_id(self, axes: Mapping[str, Any]) -> str:
        lasts = [k.rsplit(".", 1)[-1] for k in self.axes]
        parts = []
        for key, value in axes.items():
            short = key.rsplit(".", 1)[-1]
            name = short if lasts.count(short) == 1 else key
            parts.append(f"{name}={_token(value)}")
        return ",".join(parts)


def _token(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def _set(raw: dict[str, Any], key: str, value: Any, path: Path, where: str) -> None:
    try:
        set_field(raw, key, value, f" in {where}")
    except ValueError as e:
        raise SpecError(f"{path}: {where}.{key}: {e}") from None


def load_spec(path: str | os.PathLike) -> StudySpec:
    """The validated spec of a YAML file; raises SpecError (or FileNotFoundError) naming the field."""
    path = Path(path)
    if path.is_dir():
        raise SpecError(f"{path} is a directory; give the study spec file (YAML)")
    if not path.is_file():
        raise FileNotFoundError(f"study spec {path} does not exist")
    try:
        data = read_yaml(str(path))
    except ValueError as e:
        raise SpecError(str(e)) from None
    unknown = sorted(set(data) - set(SPEC_KEYS))
    if unknown:
        raise SpecError(f"{path}: unknown key(s) {unknown}; a spec has {list(SPEC_KEYS)}")

    def need(cond: bool, field: str, msg: str) -> None:
        if not cond:
            raise SpecError(f"{path}: {field}: {msg}")

    need("base" in data and isinstance(data["base"], str), "base", "required: the path of a run config (YAML)")
    base = (path.parent / data["base"]).resolve()
    need(base.is_file(), "base", f"{base} does not exist")
    try:
        base_raw = read_yaml(str(base))
    except ValueError as e:
        raise SpecError(f"{path}: base: {e}") from None
    name = data.get("name", path.stem)
    need(isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9._-]+", name or "") is not None, "name",
         f"must be letters, digits, '.', '_' or '-', got {name!r}")
    overrides = data.get("overrides") or {}
    need(isinstance(overrides, dict), "overrides", "must be a mapping of dotted keys to values")
    grids = data.get("grid") or {}
    grids = [grids] if isinstance(grids, dict) else grids
    need(isinstance(grids, list) and all(isinstance(g, dict) for g in grids), "grid",
         "must be a mapping of dotted keys to lists of values, or a list of such mappings")
    for g, grid in enumerate(grids):
        for key, values in grid.items():
            field = f"grid.{key}" if len(grids) == 1 else f"grid[{g}].{key}"
            need(isinstance(values, list) and len(values) > 0, field, f"must be a non-empty list of values, got {values!r}")
            need(len({repr(v) for v in values}) == len(values), field, f"repeats a value: {values!r}")
            need(key != SEED_KEY, field, "seeds are given by the spec's `seeds` list")
    methods = data.get("methods") or {}
    need(isinstance(methods, dict) and all(isinstance(k, str) and isinstance(v, dict) and v for k, v in methods.items()),
         "methods", "must map method names to non-empty mappings of dotted config keys to values")
    for g, grid in enumerate(grids):
        if METHOD_KEY in grid:
            field = f"grid.{METHOD_KEY}" if len(grids) == 1 else f"grid[{g}].{METHOD_KEY}"
            unknown = [v for v in grid[METHOD_KEY] if v not in methods]
            need(not unknown, field, f"{unknown} not among the spec's methods {sorted(methods)}")
    seeds = data.get("seeds", [0])
    need(isinstance(seeds, list) and seeds and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                      for s in seeds) and len(set(seeds)) == len(seeds),
         "seeds", f"must be a non-empty list of distinct integers >= 0, got {seeds!r}")
    warmup = data.get("warmup")
    if warmup is not None:
        need(isinstance(warmup, dict) and set(warmup) <= {"overrides", "model", "per_seed"}
             and isinstance(warmup.get("overrides", {}), dict), "warmup",
             "must be a mapping with an optional `overrides` mapping and `per_seed` flag, or a `model` directory")
        need(isinstance(warmup.get("per_seed", False), bool), "warmup.per_seed",
             f"must be true or false, got {warmup.get('per_seed')!r}")
        if "model" in warmup:
            need(set(warmup) == {"model"}, "warmup.model",
                 "reuses a finished warm-up: give no overrides or per_seed with it")
            template = str(warmup["model"])
            if "{seed}" in template:  # checked when the study runs (warmup_models): built after the spec
                warmup = {"model": {seed: (path.parent / template.replace("{seed}", str(seed))).resolve()
                                    for seed in seeds}}
            else:
                model = (path.parent / template).resolve()
                need((model / "config.json").is_file(), "warmup.model",
                     f"{model} has no config.json (an HF model directory)")
                warmup = {"model": model}
    resources = data.get("resources") or {}
    need(isinstance(resources, dict) and set(resources) <= set(RESOURCE_KEYS), "resources",
         f"keys must be among {list(RESOURCE_KEYS)}, got {resources!r}")
    for key, value in resources.items():
        need(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, f"resources.{key}",
             f"must be a number >= 0, got {value!r}")
    report = data.get("report") or {}
    need(isinstance(report, dict) and set(report) <= set(REPORT_KEYS), "report",
         f"keys must be among {list(REPORT_KEYS)}, got {report!r}")
    spec = StudySpec(path, name, base, base_raw, dict(overrides), [dict(g) for g in grids], list(seeds),
                     warmup, dict(resources), {"method": None, "lag": None, "reference": None, **report},
                     {k: dict(v) for k, v in methods.items()})
    for key in ("method", "lag"):
        axis = spec.report[key]
        need(axis is None or axis in spec.axes, f"report.{key}", f"{axis!r} is not an axis of the study ({spec.axes})")
    reference = spec.report["reference"]
    need(reference is None or (isinstance(reference, dict) and set(reference) <= set(spec.axes)),
         "report.reference", f"must map axes of the study to values, got {reference!r}")
    spec.cells()  # every cell's config validates, errors naming it
    spec.warmup_config()
    return spec
