"""The import rules of ARCHITECTURE.md: layers (import-linter) and the finer rules below."""

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "entr_megatron"

# GPU-only or cluster-only packages: only ever imported inside a function.
LAZY_ONLY = ("transformer_engine", "apex", "sglang", "sglang_router", "ray", "mpi4py", "flash_attn")


def _imports(path: pathlib.Path):
    """(module name, at module level?) for every import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(n) for n in tree.body}
    # `if TYPE_CHECKING:` / try-blocks at module level still count as module level.
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            top_level |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in top_level
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, id(node) in top_level
            for alias in node.names:
                yield f"{node.module}.{alias.name}", id(node) in top_level


def _py_files(sub=""):
    return sorted((PKG / sub).rglob("*.py"))


def test_layers_contract_is_kept():
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (it comes with the dev extra)")
    proc = subprocess.run([exe], cwd=PKG.parent, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_algorithm_never_imports_distributed_or_megatron():
    for path in _py_files("algorithm"):
        for name, _ in _imports(path):
            assert not name.startswith(("torch.distributed", "megatron")), f"{path.name} imports {name}"


def test_only_groups_module_reads_megatron_parallel_state():
    allowed = PKG / "parallel" / "groups.py"
    for path in _py_files():
        if path == allowed:
            continue
        for name, _ in _imports(path):
            assert not name.startswith("megatron.core.parallel_state"), f"{path.relative_to(PKG)} imports {name}"


def test_one_module_drives_megatron_pipeline_schedules():
    """Training, scoring and `convert --verify` run Megatron's schedules through one driver
    (learner/schedule.py), so each gets the same p2p communicator and process groups."""
    allowed = PKG / "learner" / "schedule.py"
    for path in _py_files():
        if path == allowed:
            continue
        for name, _ in _imports(path):
            assert not name.startswith("megatron.core.pipeline_parallel"), f"{path.relative_to(PKG)} imports {name}"


def test_gpu_and_cluster_packages_are_imported_lazily():
    for path in _py_files():
        for name, top in _imports(path):
            if name.split(".")[0] in LAZY_ONLY:
                assert not top, f"{path.relative_to(PKG)} imports {name} at module level"


def test_import_rules_would_catch_a_violation(tmp_path):
    """The AST scan sees module-level and nested imports (guards against a scan that finds nothing)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\ndef f():\n    import sglang\n")
    assert list(_imports(bad)) == [("torch.distributed", True), ("sglang", False)]
