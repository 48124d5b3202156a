"""RunConfig from a YAML file plus dotted command-line overrides, and back to YAML.

    cfg = load_config("examples/cpu_demo.yaml", ["controller.mode=sync", "algorithm.tau=0.3"])

Values are parsed with YAML scalar rules (`true`, `1e-6`, `[1, 2]`, `null`). Unknown keys,
in the file or in an override, fail with the valid keys at that level and a "did you
mean"; .inf and .nan fail in every float field (and inside `model.architecture`). An empty
file is refused rather than read as "all defaults". A config is a regular file of at most
MAX_CONFIG_BYTES whose YAML, aliases expanded, holds at most MAX_CONFIG_NODES values nested at
most MAX_CONFIG_DEPTH deep (an override's value too): a device, an alias bomb or a deep nest is
refused before it is read whole or walked. Everything is validated here, before any process
starts. Layer L0.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import stat
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from entr_megatron.config.run import RunConfig
from entr_megatron.config.validate import NOT_FINITE, FieldError, is_non_finite


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-6` as a float (YAML 1.1 wants `1.0e-6`) and refuses duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
            seen[key] = True
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent, index):
        """The composed node, with its anchor's name kept as `node.anchor` (for the bounds' messages)."""
        alias = self.check_event(yaml.AliasEvent)
        anchor = None if alias else self.peek_event().anchor
        node = super().compose_node(parent, index)
        if anchor is not None:
            node.anchor = anchor
        return node


MAX_CONFIG_BYTES = 1 << 20
"""Largest config file read (1 MiB; the examples are under 10 KiB)."""
MAX_CONFIG_NODES = 100_000
"""Most YAML values (scalars, lists, mappings) a file or an override may hold once its aliases are
expanded: each `*name` counts the whole value it stands for (the examples hold under 1000)."""
MAX_CONFIG_DEPTH = 100
"""Deepest nesting of lists and mappings in a config."""


class YamlBoundError(ValueError):
    """A YAML text over MAX_CONFIG_NODES values (aliases expanded) or nested over MAX_CONFIG_DEPTH."""


def _check_bounds(node: yaml.Node) -> None:
    """Raises YamlBoundError when the composed document `node`, aliases expanded, is over the bounds;
    each node is visited once (an alias is a node seen before: its size is remembered)."""
    sizes: dict[int, int] = {}
    open_: dict[int, str] = {}  # nodes being counted -> their anchor (an alias back to one is a cycle)
    stack: list[tuple[yaml.Node, int, bool]] = [(node, 1, False)]
    while stack:
        current, depth, done = stack.pop()
        key = id(current)
        if done:
            children = _children(current)
            sizes[key] = min(1 + sum(sizes[id(c)] for c in children), MAX_CONFIG_NODES + 1)
            del open_[key]
            if sizes[key] > MAX_CONFIG_NODES:
                raise YamlBoundError(
                    f"the YAML expands to more than {MAX_CONFIG_NODES} values (aliases (*name) count the whole "
                    f"value they repeat); a config holds far fewer")
            continue
        if key in sizes:
            continue
        if key in open_:
            raise YamlBoundError(f"the YAML has a recursive alias (*{open_[key]} inside &{open_[key]})")
        if depth > MAX_CONFIG_DEPTH:
            raise YamlBoundError(f"the YAML nests deeper than {MAX_CONFIG_DEPTH} levels of lists and mappings")
        open_[key] = getattr(current, "anchor", None) or "?"
        stack.append((current, depth, True))
        stack.extend((child, depth + 1, False) for child in _children(current))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _load_bounded(text: str) -> Any:
    """`yaml.load(text, _Loader)` once the composed document is within the bounds (YamlBoundError);
    composing reads each alias as a reference, so it is linear in the text."""
    loader = _Loader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise YamlBoundError(f"the YAML nests deeper than {MAX_CONFIG_DEPTH} levels of lists and mappings") from None
        if node is None:
            return None
        _check_bounds(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings `_Loader` would read as floats (e.g. "1e-6")."""


_FLOAT = (
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
_Loader.add_implicit_resolver(*_FLOAT)
_Dumper.add_implicit_resolver(*_FLOAT)


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """The validated RunConfig of a YAML file (None: the defaults) with `key.path=value` overrides applied.

    Raises ValueError naming the file, the dotted field, the bad value and what is allowed (also
    for a file that is empty, holds only comments or `null`); FileNotFoundError when `path` does
    not exist."""
    overrides = list(overrides)
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(os.fspath(path))
        if not raw:  # an empty file would silently run the built-in defaults
            raise ValueError(f"{os.fspath(path)}: the config is empty (see examples/cpu_demo.yaml)")
    for item in overrides:
        _apply_override(raw, item)
    try:
        return config_from_dict(raw)
    except ValueError as e:
        where = [f"file {os.fspath(path)}"] if path is not None else []
        where += [f"overrides {overrides}"] if overrides else []
        raise ValueError(f"{e}{'  [' + '; '.join(where) + ']' if where else ''}") from None


def config_from_dict(data: Mapping[str, Any]) -> RunConfig:
    """The validated RunConfig of a nested mapping (the parsed YAML), unknown keys refused."""
    return _build(RunConfig, data, "")


def dump_config(cfg: RunConfig) -> str:
    """The YAML text of `cfg`; `load_config` of it gives back an equal RunConfig."""
    return yaml.dump(_plain(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def config_as_dict(cfg: RunConfig) -> dict[str, Any]:
    """`cfg` as plain nested dicts and lists (what dump_config writes)."""
    return _plain(cfg)


def parse_value(text: str) -> Any:
    """A command-line value with YAML scalar rules: `true`, `1e-6`, `[1, 2]`, `null`, `sync`."""
    try:
        return _load_bounded(text) if text.strip() else ""
    except YamlBoundError as e:
        raise ValueError(f"cannot use {text[:80]!r}{'...' if len(text) > 80 else ''} as a value: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"cannot parse {text!r} as a YAML value: {e}") from None


# ---------------------------------------------------------------- reading


def read_yaml(path: str) -> dict[str, Any]:
    """The top-level mapping of a YAML file (empty file: {}); errors name the file (and line): a
    missing file raises FileNotFoundError, a directory, an unreadable or non-UTF-8 file ValueError."""
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory, not a YAML file")
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{path}: not a regular file (a device, pipe or socket); a config is a YAML file")
            data = f.read(MAX_CONFIG_BYTES + 1)
            if len(data) > MAX_CONFIG_BYTES:
                size = os.fstat(f.fileno()).st_size
                raise ValueError(f"{path}: {size} bytes, over the {MAX_CONFIG_BYTES} bytes a config may have")
    except OSError as e:
        raise ValueError(f"{path}: cannot read the file: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}:{line}:{column}: not UTF-8 text (byte 0x{data[e.start]:02x}); "
                         "a config is a UTF-8 YAML file") from None
    try:
        data = _load_bounded(text)
    except YamlBoundError as e:
        raise ValueError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        line = text.splitlines()[mark.line] if mark is not None and mark.line < len(text.splitlines()) else ""
        problem = getattr(e, "problem", None) or str(e)
        context = f"\n    {line}" if line else ""
        raise ValueError(f"{path}{at}: YAML syntax error: {problem}{context}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections (model:, rollout:, ...), "
                         f"got {type(data).__name__}")
    return data


# ---------------------------------------------------------------- schema


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in typing.get_type_hints(cls).items() if k in names}


def _section_type(hint: Any) -> tuple[type | None, bool]:
    """(the dataclass a field holds or None, whether None is allowed)."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    optional = type(None) in args
    classes = [a for a in args if dataclasses.is_dataclass(a)]
    return (classes[0] if classes else None), optional


def _is_mapping_field(hint: Any) -> bool:
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return any(typing.get_origin(a) is dict or a is dict for a in args)


def _is_float_field(hint: Any) -> bool:
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return float in args and int not in args


def _unknown_key(key: Any, cls: type, path: str, context: str = "") -> ValueError:
    valid = list(_hints(cls))
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f": did you mean {close[0]!r}?" if close else "."
    where = f"'{path}'" if path else "the top level"
    return ValueError(f"unknown key {key!r} at {where}{context}{hint} Valid keys: {', '.join(valid)}")


def _refuse_non_finite(section: str, name: str, value: Any, in_mapping: bool = False) -> None:
    """.inf / .nan in a float field, or anywhere inside a free-form mapping (model.architecture), is
    refused naming its dotted path. A list-valued field (the ratio bands) is its validator's to
    judge: a band's upper end may be .inf."""
    if is_non_finite(value) or (in_mapping and isinstance(value, list) and any(map(is_non_finite, value))):
        raise FieldError(section, name, value, NOT_FINITE)
    if isinstance(value, Mapping):
        for key, item in value.items():
            _refuse_non_finite(f"{section}.{name}" if section else name, str(key), item, in_mapping=True)


def _build(cls: type, data: Any, path: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        keys = ", ".join(_hints(cls))
        raise ValueError(f"{path or 'config'}={data!r} is not valid; must be a mapping with keys: {keys}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in hints:
            raise _unknown_key(key, cls, path)
        sub = f"{path}.{key}" if path else key
        section, optional = _section_type(hints[key])
        if section is not None:
            if value is None and optional:
                kwargs[key] = None
            else:
                kwargs[key] = _build(section, {} if value is None else value, sub)
        elif _is_float_field(hints[key]) and isinstance(value, int) and not isinstance(value, bool):
            kwargs[key] = float(value)
        else:
            if _is_float_field(hints[key]) or _is_mapping_field(hints[key]):
                _refuse_non_finite(path, key, value)
            kwargs[key] = value
    try:
        return cls(**kwargs)
    except FieldError as e:
        # A section's own error names the path where the section sits in this run (e.g. a
        # reused AlgorithmConfig's `AlgorithmConfig.tau` is `algorithm.tau` here).
        raise (e.at(path) if e.section == cls.SECTION else e) from None


# ---------------------------------------------------------------- overrides


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {item!r} is not valid; must be key.path=value, e.g. controller.mode=sync")
    set_field(raw, key, parse_value(text), f" in override {item!r}", item)


def set_field(raw: dict[str, Any], key: str, value: Any, where: str = "", item: str | None = None) -> None:
    """Sets the dotted field `key` (e.g. "algorithm.tau") of a raw config mapping to `value`, creating
    sections on the way. Raises ValueError naming the key when no such field exists (`where` says
    where the key came from, e.g. " in override 'x=1'")."""
    item = item if item is not None else key
    parts = key.split(".")
    cls: type | None = RunConfig
    node = raw
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        last = i == len(parts) - 1
        seed: dict[str, Any] = {}
        if cls is not None:
            seed = _mapping_default(cls, part)
            if part not in _hints(cls):
                raise _unknown_key(part, cls, prefix, where)
            hint = _hints(cls)[part]
            section, _ = _section_type(hint)
            if section is None and not last and not _is_mapping_field(hint):
                value_path = ".".join(parts[: i + 1])
                kind = "override " if item != key else "key "
                raise ValueError(f"{kind}{item!r} is not valid{where if item == key else ''}; "
                                 f"{value_path} is a value, not a section")
            cls = section
        if last:
            node[part] = value
        else:
            if not isinstance(node.get(part), dict):
                node[part] = seed  # model.architecture.x=1 edits the default architecture
            node = node[part]


def _mapping_default(cls: type, name: str) -> dict[str, Any]:
    """A copy of the default of a free-form mapping field (e.g. model.architecture); {} otherwise."""
    if name not in _hints(cls) or not _is_mapping_field(_hints(cls)[name]):
        return {}
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return dict(default) if isinstance(default, dict) else {}


# ---------------------------------------------------------------- dumping


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value
