"""Imports at the top, except where a function-level import buys something (docs/CONTRIBUTING.md).

A function-level import (any import statement below a `def`; module-level `if` / `try` blocks are
the top, `if TYPE_CHECKING:` blocks are not imports at run time) must either
- bring a heavy or optional package (HEAVY) that the module's own top does not already import:
  itself (`import torch` in a module without torch), or one of our modules whose top imports one,
  directly or through other modules (`from entr_megatron.learner.build import ...` in a module
  without megatron): the package is its reason, or
- carry a `# lazy: <reason>` comment on its line, or on the comment lines just above its block of
  imports (one comment covers the block).
What a module's top imports is read from the source (module-level imports, followed through our
own modules and their packages' `__init__`), not by importing it.
"""

from __future__ import annotations

import ast
import functools
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "entr_megatron"

HEAVY = frozenset((
    # seconds of import, or GPU / cluster only
    "torch", "megatron", "transformers", "transformer_engine", "apex", "flash_attn", "triton", "sglang",
    "sglang_router", "ray", "mpi4py", "tokenizers", "tensorboard",
    # optional extras (pyproject.toml): study, math, agent
    "pandas", "pyarrow", "matplotlib", "scipy", "wandb", "math_verify", "bm25s",
))
"""Packages whose import a light process (`--help`, the controller, an engine) should not pay for."""

PENDING = {
    ("controller/ranks/ray_engine.py", "entr_megatron.rollout.embedded"),
    ("controller/ranks/ray_engine.py", "entr_megatron.utils.node_address"),
    ("controller/job/sglang_servers.py", "entr_megatron.config.rollout"),
    ("controller/job/sglang_servers.py", "entr_megatron.controller.ranks.remote"),
    ("controller/job/sglang_servers.py", "entr_megatron.rollout.sglang"),
    ("controller/job/sglang_servers.py", "entr_megatron.rollout.sglang.client"),
    ("controller/job/sglang_servers.py", "entr_megatron.utils.spawn"),
    ("controller/job/sglang_setup.py", "entr_megatron.models"),
    ("controller/job/sglang_setup.py", "entr_megatron.rollout.sglang"),
    ("controller/job/sglang_setup.py", "entr_megatron.rollout.sglang.client"),
    ("controller/job/wiring.py", "entr_megatron.config.task"),
    ("controller/job/wiring.py", "entr_megatron.controller.ranks.ray_engine"),
    ("controller/job/wiring.py", "entr_megatron.rollout.embedded"),
    ("controller/job/wiring.py", "entr_megatron.rollout.episodes"),
    ("controller/job/wiring.py", "entr_megatron.weight_sync"),
    ("controller/ranks/workers.py", "entr_megatron.checkpoint.directory"),
    ("utils/node_address.py", "torch.distributed"),
    ("utils/node_address.py", "torch.distributed.distributed_c10d"),
}
"""(module, what it imports in a function) not yet moved or given a reason: modules other work of
issues 44 and 45 was changing when this test was written. Remove an entry once it passes."""


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: its body's, and those of module-level
    `if` / `try` blocks, except `if TYPE_CHECKING:`."""
    found = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            found += _top_level(node.orelse) + ([] if "TYPE_CHECKING" in ast.unparse(node.test) else _top_level(node.body))
        elif isinstance(node, ast.Try):
            found += _top_level(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
    return found


def _function_level(tree: ast.Module):
    """Every import statement inside a function (of a class, nested in blocks, ...)."""
    def visit(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            yield from visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))
    yield from visit(tree, False)


class Package:
    """The modules below `root` and what importing each one imports (statically)."""

    def __init__(self, root: pathlib.Path = PKG):
        self.root = root
        self.files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
        self.trees = {name: ast.parse(p.read_text(), filename=str(p)) for name, p in self.files.items()}

    def targets(self, node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
        """The modules an import statement of `module` names (`from P import X`: P.X when X is a module)."""
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            package = module if self.files[module].name == "__init__.py" else module.rpartition(".")[0]
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in self.files else base for a in node.names]

    def _ours(self, target: str) -> list[str]:
        """Our modules that importing `target` runs: its packages' `__init__` and itself."""
        parts = target.split(".")
        return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in self.files]

    def heavy(self, target: str) -> frozenset[str]:
        """The HEAVY packages that importing `target` (ours or not) imports."""
        if target.split(".")[0] != self.root.name:
            return frozenset({target.split(".")[0]}) & HEAVY
        return frozenset().union(*(self._heavy_module(m) for m in self._ours(target)))

    @functools.cache
    def _imports(self, module: str) -> tuple[frozenset[str], frozenset[str]]:
        """(HEAVY packages, our other modules) that `module`'s top imports directly."""
        heavy, ours = set(), set()
        for node in _top_level(self.trees[module].body):
            for target in self.targets(node, module):
                if target.split(".")[0] == self.root.name:
                    ours |= set(self._ours(target)) - {module}
                else:
                    heavy |= {target.split(".")[0]} & HEAVY
        return frozenset(heavy), frozenset(ours)

    @functools.cache
    def _heavy_module(self, module: str) -> frozenset[str]:
        """The HEAVY packages importing `module` imports, through our modules too."""
        found, seen, todo = set(), {module}, [module]
        while todo:
            heavy, ours = self._imports(todo.pop())
            found |= heavy
            todo += ours - seen
            seen |= ours
        return frozenset(found)

    def unexplained(self) -> list[tuple[str, int, str]]:
        """(file below the root, line, imported module) of each function-level import that brings no
        heavy package the module lacks and has no `# lazy:` comment."""
        found = []
        for module, tree in self.trees.items():
            lines = self.files[module].read_text().splitlines()
            own = self._heavy_module(module)
            import_lines = {i for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                            for i in range(node.lineno, node.end_lineno + 1)}
            for node in _function_level(tree):
                if _has_reason(lines, node, import_lines):
                    continue
                for target in self.targets(node, module):
                    if not self.heavy(target) - own:
                        found.append((self.files[module].relative_to(self.root).as_posix(), node.lineno, target))
        return found


def _has_reason(lines: list[str], node: ast.stmt, import_lines: set[int]) -> bool:
    """A `# lazy:` comment on the import's lines, or on a comment line above it with only imports
    and comments between (one comment covers the block of imports below it)."""
    if any("# lazy:" in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1)):
        return True
    above = node.lineno - 1
    while above >= 1:
        text = lines[above - 1].strip()
        if text.startswith("# lazy:"):
            return True
        if not (text.startswith("#") or above in import_lines):
            return False
        above -= 1
    return False


def test_every_function_level_import_buys_something():
    found = Package().unexplained()
    failing = [f for f in found if (f[0], f[2]) not in PENDING]
    assert not failing, ("function-level imports that bring no heavy package the module lacks and give no "
                         "'# lazy:' reason (move them to the top, or say why):\n"
                         + "\n".join(f"  {path}:{line}: {target}" for path, line, target in failing))
    stale = PENDING - {(path, target) for path, _, target in found}
    assert not stale, f"these pass now: remove them from PENDING: {sorted(stale)}"


def test_the_check_sees_what_an_import_buys(tmp_path):
    """Heavy imports the module lacks pass; one it has already, a light one, and ours that add
    nothing fail unless a `# lazy:` comment gives the reason (on the line, or above the block)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "light.py").write_text("import json\n")
    (pkg / "via.py").write_text("from pkg import light\nimport torch.distributed\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import pandas\n"
        "def f():\n"
        "    import pandas\n"  # heavy, not at the top: passes
        "    from . import via\n"  # ours, brings torch: passes
        "    import json\n"  # light: fails
        "    from pkg import light  # lazy: a reason\n"
        "    # lazy: a block\n"
        "    import csv\n"
        "    import io\n"
        "    if True:\n"
        "        import os\n")  # light, nested: fails
    (pkg / "b.py").write_text(
        "import torch\n"
        "class C:\n"
        "    def m(self):\n"
        "        import torch.distributed\n"  # heavy, already at the top: fails
        "        from pkg import via\n")  # brings only torch, already there: fails
    found = Package(pkg).unexplained()
    assert sorted(found) == [("a.py", 7, "json"), ("a.py", 13, "os"), ("b.py", 4, "torch.distributed"),
                             ("b.py", 5, "pkg.via")], found
