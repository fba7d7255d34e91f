"""Importing ropescale: the torch it was built against, the instruction set its CPU kernels use, the
`ropescale` command."""

import ast
import json
import os
import shutil
import subprocess
import textwrap
import sys
from pathlib import Path

import pytest
import torch

import ropescale
from ropescale import _build_config, _torch_mismatch


def test_build_config_matches_the_running_torch():
    # The generated file and the library agree with each other and with the torch running them.
    assert _build_config.TORCH_VERSION == ropescale.build_info()["torch_version"]
    assert _build_config.TORCH_VERSION.split("+")[0].split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]
    assert bool(_build_config.TORCH_CUDA) == (torch.version.cuda is not None)


@pytest.mark.parametrize("built, built_cuda, running, running_cuda", [
    ("2.14.1", "13.0", "2.14.0", "12.8"),      # patch releases and CUDA minor versions share the ABI
    ("2.13.0+cpu", "", "2.13.0", None),
    ("2.11.0+cu130", "13.0", "2.11.0", "13.0"),
])
def test_compatible_torch_is_accepted(built, built_cuda, running, running_cuda):
    assert _torch_mismatch(built, built_cuda, running, running_cuda) is None


@pytest.mark.parametrize("built, built_cuda, running, running_cuda, says", [
    ("2.14.1", "13.0", "2.13.0+cpu", None, "built against torch 2.14.1 (CUDA 13.0), but this Python runs torch 2.13.0+cpu (CPU-only)"),
    ("2.13.0+cpu", "", "2.14.1", "13.0", "torch 2.13.0+cpu (CPU-only)"),
    ("2.13.0", "", "2.13.0", "13.0", "runs torch 2.13.0 (CUDA 13.0)"),
    ("2.11.0", "13.0", "3.11.0", "13.0", "runs torch 3.11.0"),
])
def test_mismatched_torch_is_refused_with_the_rebuild_command(built, built_cuda, running, running_cuda, says):
    message = _torch_mismatch(built, built_cuda, running, running_cuda)
    assert message is not None and says in message
    assert "pip install --no-build-isolation" in message and ropescale.SUPPORTED_TORCH in message


def test_import_refuses_a_library_built_for_another_torch(tmp_path):
    # A copy of the package whose build record names another torch: import fails before _C loads.
    package = tmp_path / "ropescale"
    shutil.copytree(Path(ropescale.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "_build_config.py").write_text('TORCH_VERSION = "1.13.1"\nTORCH_CUDA = ""\n')
    result = subprocess.run([sys.executable, "-c", "import ropescale"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert result.returncode != 0
    assert "ImportError: ropescale's native library was built against torch 1.13.1 (CPU-only)" in result.stderr
    assert "_C" not in result.stderr.split("ImportError")[0].split("\n")[-2]  # raised by the check, not the loader


def _cpu_has_avx512() -> bool:
    return bool(getattr(torch.cpu, "_is_avx512_supported", lambda: False)())


@pytest.mark.skipif(_cpu_has_avx512(), reason="this CPU has AVX-512: nothing to cap")
def test_forced_avx512_on_a_cpu_without_it_runs_a_variant_the_cpu_has():
    # ATEN_CPU_CAPABILITY=avx512 makes torch report AVX512 without asking the CPU; ropescale's own
    # kernel choice is capped at what cpuinfo reports, so its ops never raise SIGILL.
    script = ("import torch, ropescale; print(torch.backends.cpu.get_cpu_capability(), ropescale._C.rotary_cpu_isa())")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx512",
           "PYTHONPATH": str(Path(ropescale.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    torch_says, ropescale_runs = result.stdout.split()
    assert torch_says == "AVX512"
    assert ropescale_runs == ("AVX2" if torch.cpu._is_avx2_supported() else "DEFAULT")


def test_console_script_runs():
    # setup.sh and pip both put a `ropescale` command beside the interpreter.
    command = Path(sys.executable).parent / "ropescale"
    if not command.exists():
        pytest.fail(f"no `ropescale` command beside {sys.executable}: setup.sh / pip install should write it")
    result = subprocess.run([str(command), "--help"], capture_output=True, text=True, check=True)
    assert "usage: ropescale" in result.stdout and "table" in result.stdout


# What a venv holding only ropescale's requirements (pyproject: torch, numpy, tqdm) lacks: every optional
# dependency and every test package. (scripts/test_torch_compat.sh checks the wheel requires exactly those three.)
_NOT_REQUIRED = ("transformers", "vllm", "matplotlib", "gguf", "accelerate", "wonderwords", "safetensors",
                 "huggingface_hub", "tokenizers", "pytest", "scipy", "pandas")
_WITH_REQUIREMENTS_ONLY = textwrap.dedent('''
    import importlib.abc, sys
    BLOCKED = set(sys.argv[1].split(","))

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (not one of ropescale's requirements)")
            return None

    sys.meta_path.insert(0, Blocked())
    import torch, ropescale
    from ropescale import cli
    assert list(torch.ops.ropescale.yarn_inv_freq(128, 1e4, 4.0, 4096).shape) == [64]
    try:
        cli.main(["--help"])
    except SystemExit as done:
        assert done.code == 0
    cli.main(["table", "--method", "yarn", "--factor", "4", "--dim", "8", "--json"])
''')


def test_ropescale_and_its_command_run_with_its_requirements_only():
    """A user's fresh venv (README's install) holds torch, numpy and tqdm: ropescale, an op and the `ropescale`
    command run there, every optional dependency and test package blocked."""
    result = subprocess.run([sys.executable, "-c", _WITH_REQUIREMENTS_ONLY, ",".join(_NOT_REQUIRED)],
                            capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: ropescale" in result.stdout and '"inv_freq"' in result.stdout


# The ops with a CUDA kernel: the rotary ops and the ReRoPE attention ops (DESIGN.md, "Public surface").
_CUDA_OPS = {name for name in ropescale.ops.__all__ if name.startswith("apply_rotary")} | {
    "rerope_attention", "rerope_attention_paged", "rerope_attention_paged.workspace", "rerope_cache_write_"}


def test_every_gpu_op_has_a_cuda_kernel_in_every_build():
    # A build without CUDA kernels still registers the CUDA key of these ops (with an error that says how
    # to rebuild): a GPU user never meets the dispatcher's "Could not run ... from the 'CUDA' backend".
    assert {"apply_rotary", "apply_rotary_qk_", "apply_rotary_pos_qk"} <= _CUDA_OPS
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("ropescale::")
                  and torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")}
    assert registered == _CUDA_OPS


@pytest.mark.skipif(ropescale.build_info()["cuda"], reason="this build has CUDA kernels: the CUDA key runs them")
def test_a_build_without_cuda_kernels_says_how_to_rebuild_on_cuda_tensors():
    # The CUDA kernel of a CPU-only build, reached through the dispatcher as a CUDA tensor would reach it.
    x, cos = torch.randn(1, 1, 2, 4), torch.randn(2, 4)
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(RuntimeError, match=r"apply_rotary: this ropescale library was built without CUDA kernels"
                                           r".*ROPESCALE_CUDA=ON pip install --no-build-isolation"):
        torch.ops.ropescale.apply_rotary.default.redispatch(cuda, x, cos, cos)


# ---------------------------------------------------------------------------------------------
# The package's import layering (docs/DESIGN.md, "Python layers"): no import circle, every import at the top
# of its module, the op layer importing only downwards, no file over 600 lines, and a name one module takes from
# another is that module's public surface.

PACKAGE = Path(ropescale.__file__).parent

# The op layer, lowest first, each with the package modules it may import (at the top or lazily). Whatever is
# not in it (scaling, hf, vllm, cli, ...) sits above and may import any of these.
OP_LAYER = {
    "_composite": set(),  # torch only; validates with torch.ops.ropescale._check_*
    "reference": {"_C", "_composite"},
    "rerope": {"_C", "_composite", "reference"},
    "rerope_train_kernels": set(),
    "rerope_train_layout": set(),
    "rerope_train_plan": {"_composite", "rerope_train_kernels"},
    "rerope_train": {"_composite", "rerope", "rerope_train_kernels", "rerope_train_layout", "rerope_train_plan"},
    "ops_frequencies": {"_C"},
    "ops_rotary": {"_C"},
    "ops": {"_C", "rerope", "rerope_train", "ops_frequencies", "ops_rotary"},
    "cache": set(),
    "sharding": set(),
}

# Modules that still import below a statement, each with why; the test fails once one no longer does, so
# that the entry goes.
IMPORTS_BELOW_A_STATEMENT: dict[str, str] = {}

# Import circles the package still has, each by the import that closes it, (importer, imported): an import inside
# a function (never one at the top: a circle at import time has no exception), with why. The circle test leaves
# these imports out; test_each_known_import_circle_is_still_there fails once one no longer closes a circle, so
# that the entry goes.
KNOWN_IMPORT_CIRCLES: dict[tuple[str, str], str] = {}

# Names a package module takes from another although they are that module's own (a leading underscore), each
# (importer, owner, name) with why; test_no_module_takes_a_private_name_from_another fails once one is gone.
KNOWN_PRIVATE_IMPORTS: dict[tuple[str, str, str], str] = {}

#: No package file is longer (docs/DESIGN.md, "Layout": a file per role).
MAX_LINES = 600


def _package_modules() -> dict[str, ast.Module]:
    """Every Python module of the package, by dotted name inside it ("ops", "hf.patch"; "" is the package's
    own __init__), parsed."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = ast.parse(path.read_text(), str(path))
    return modules


def _is_submodule(name: str) -> bool:
    """Whether the package has a module of that dotted name (a .py file, a subpackage or a native library)."""
    if not name:
        return False
    path = PACKAGE.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists() or any(
        path.parent.glob(path.name + ".*.so"))


def _import_base(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import of ``module`` names (``from ..config import x`` in hf.patch:
    ropescale.config)."""
    if node.level == 0:
        return node.module
    is_package = module == "" or (PACKAGE.joinpath(*module.split(".")) / "__init__.py").exists()
    parts = ["ropescale", *filter(None, module.split("."))]
    parts = parts if is_package else parts[:-1]
    return ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package modules an import statement of ``module`` imports, by dotted name inside the package: each
    submodule named, or the module a name is taken from (``from . import __version__``: the package's __init__,
    "")."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _import_base(module, node)
        names = [f"{base}.{alias.name}" if _is_submodule(f"{base}.{alias.name}".partition(".")[2]) else base
                 for alias in node.names]
    inner = {name.partition(".")[2] for name in names if name == "ropescale" or name.startswith("ropescale.")}
    return inner - {module}


def _is_import_block(node: ast.stmt) -> bool:
    """An import, or a ``try`` whose body is imports only (an import with an error message of its own)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    return isinstance(node, ast.Try) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body)


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    return [n for node in tree.body if _is_import_block(node)
            for n in ([node] if not isinstance(node, ast.Try) else node.body)]


def test_every_import_is_at_the_top_of_its_module():
    # The top: the docstring, then imports only (`from __future__` first). An import further down is an import
    # circle worked around, or an ordering the reader cannot see.
    late = {}
    for name, tree in _package_modules().items():
        body = tree.body[1:] if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(
            getattr(tree.body[0], "value", None), ast.Constant) else tree.body
        first_other = next((i for i, node in enumerate(body) if not _is_import_block(node)), len(body))
        lines = [node.lineno for node in body[first_other:] if _is_import_block(node)]
        if lines:
            late[name] = lines
    assert set(late) == set(IMPORTS_BELOW_A_STATEMENT), late


def _import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Each module's package imports, from EVERY import statement in it: at the top, inside a function, under
    ``if TYPE_CHECKING:``. A function's import runs later but is as much a dependency as one at the top, and a
    type-checking import is the reader's (hf's circle, patch -> pre_rope -> requests -> patch, ran through those):
    a graph of top imports only lets a circle hide behind a lazy import. A submodule is its own node (importing
    ``hf.state`` runs ``hf/__init__`` first, but every module is below its package's __init__, which is no
    circle of the reader's: the package's __init__ imports what it re-exports)."""
    return {name: set().union(*(_imported(name, node) for node in ast.walk(tree)
                                if isinstance(node, (ast.Import, ast.ImportFrom))))
            for name, tree in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's import circles: its strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def test_the_package_has_no_import_circle():
    # Every import (top, in a function, under TYPE_CHECKING), less the known circles' closing imports.
    modules = _package_modules()
    graph = _import_graph(modules)
    assert {"_composite", "ops", "hf.patch"} <= set(graph) and "rerope" in graph["ops"]  # the graph
    for importer, imported in KNOWN_IMPORT_CIRCLES:
        graph[importer].discard(imported)
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(circle) for circle in circles)


def test_each_known_import_circle_is_still_there():
    modules = _package_modules()
    graph = _import_graph(modules)
    top = {name: set().union(*(_imported(name, node) for node in _module_level_imports(tree)))
           for name, tree in modules.items()}
    circles = _circles(graph)
    for importer, imported in KNOWN_IMPORT_CIRCLES:
        assert imported not in top[importer], f"{importer} imports {imported} at the top: a circle at import time"
        assert any({importer, imported} <= set(circle) for circle in circles), (
            f"{importer} -> {imported} closes no circle any more: remove it from KNOWN_IMPORT_CIRCLES")


def test_the_circle_test_sees_a_circle_through_a_lazy_or_type_checking_import():
    # hf's circle as it was (patch imports pre_rope at the top; pre_rope names patch's state under TYPE_CHECKING;
    # requests imports patch in a function): the graph holds it, the walk names it.
    code = {"hf.patch": "from .pre_rope import attend\n",
            "hf.pre_rope": "from typing import TYPE_CHECKING\nfrom .requests import planned\n"
                           "if TYPE_CHECKING:\n    from .patch import State\n",
            "hf.requests": "def planned():\n    from . import patch\n",
            "hf.state": "import torch\n"}
    graph = _import_graph({name: ast.parse(text) for name, text in code.items()})
    assert graph["hf.pre_rope"] == {"hf.requests", "hf.patch"} and graph["hf.requests"] == {"hf.patch"}
    assert _circles(graph) == [["hf.patch", "hf.pre_rope", "hf.requests"]]


def test_no_package_file_is_over_600_lines():
    # Every .py file of the package, whoever owns it: a longer one is split by role (docs/DESIGN.md, "Layout").
    over = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines())
            for path in sorted(PACKAGE.rglob("*.py")) if len(path.read_text().splitlines()) > MAX_LINES}
    assert not over, f"package files over {MAX_LINES} lines: {over}"


def _private_names_taken(module: str, tree: ast.Module) -> set[tuple[str, str]]:
    """``(owner, name)`` for each name with a leading underscore (not a dunder) that ``module`` takes from another
    package module ``owner``: ``from .owner import _name``, or ``alias._name`` where ``alias`` is a package module
    it imported. A private submodule (``_composite``, ``_C``) is a module, not a name: not counted."""
    aliases, taken = {}, set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = _import_base(module, node)
        if base != "ropescale" and not base.startswith("ropescale."):
            continue
        for alias in node.names:
            owner = base.partition(".")[2]
            if _is_submodule(f"{owner}.{alias.name}".lstrip(".")):
                aliases[alias.asname or alias.name] = f"{owner}.{alias.name}".lstrip(".")
            elif alias.name.startswith("_") and not alias.name.startswith("__") and owner != module:
                taken.add((owner, alias.name))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and not _is_submodule(f"{aliases[node.value.id]}.{node.attr}")):
            taken.add((aliases[node.value.id], node.attr))
    return taken


def test_no_module_takes_a_private_name_from_another():
    # Names one module takes from another are that module's public surface (no leading underscore across files).
    taken = {(module, owner, name) for module, tree in _package_modules().items()
             for owner, name in _private_names_taken(module, tree)}
    assert taken == set(KNOWN_PRIVATE_IMPORTS), (
        f"private names taken across modules: {sorted(taken - set(KNOWN_PRIVATE_IMPORTS))}; known ones no longer "
        f"taken (remove them): {sorted(set(KNOWN_PRIVATE_IMPORTS) - taken)}")


def test_the_op_layer_imports_only_downwards():
    modules = _package_modules()
    for name, allowed in OP_LAYER.items():
        imported = set().union(*(_imported(name, node) for node in ast.walk(modules[name])
                                 if isinstance(node, (ast.Import, ast.ImportFrom)))) - {name}
        assert imported <= allowed, f"{name} imports {sorted(imported - allowed)}, above it"


def test_the_composites_call_no_kernel_op():
    # The plain-PyTorch math is what ROPESCALE_KERNELS=reference routes the kernel ops to: calling one of them
    # would recurse there. Of torch.ops.ropescale it uses the argument checks only.
    tree = ast.parse((PACKAGE / "_composite.py").read_text())
    called = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
              and ast.unparse(node.value) == "torch.ops.ropescale"}
    assert called and all(name.startswith("_check_") for name in called), called


def test_the_op_layer_imports_lazily_only_with_a_reason():
    # An import inside a function is for a heavy optional dependency, and says so ("lazy") in the comment
    # block just above it or on its line.
    for name in OP_LAYER:
        path = PACKAGE / f"{name}.py"
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        top = set(map(id, _module_level_imports(tree)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                above, i = [lines[node.lineno - 1]], node.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    above.append(lines[i])
                    i -= 1
                comment = " ".join(line.split("#", 1)[1] for line in above if "#" in line)
                assert "lazy" in comment.lower(), f"{path.name}:{node.lineno}: a lazy import without its reason"


# In a fresh process, the package's modules imported one by one without the package's __init__ (which imports
# everything), lowest first: each brings in only what OP_LAYER allows it. Then the composite, with nothing
# above it loaded, computes and refuses as the op does.
_LAYERS_ALONE = """
import importlib, json, sys, types
import torch
package = types.ModuleType("ropescale")
package.__path__ = [sys.argv[1]]
sys.modules["ropescale"] = package
allowed = json.loads(sys.argv[2])

def loaded():
    return {name.split(".", 1)[1] for name in sys.modules if name.startswith("ropescale.")}

importlib.import_module("ropescale._C")
for name, below in allowed.items():
    before = loaded()
    importlib.import_module("ropescale." + name)
    extra = loaded() - before - {name} - set(below)
    assert not extra, f"importing {name} loaded {sorted(extra)}"
    if name == "_composite":
        assert loaded() == {"_C", "_composite"}, loaded()
        composite = sys.modules["ropescale._composite"]
        q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
        positions, inv_freq = torch.arange(5)[None], torch.rand(4, dtype=torch.float64)
        out, lse = composite.rerope_attention_composite(q, q, q, positions, positions, inv_freq, 2)
        assert out.shape == q.shape and torch.isfinite(lse).all()
        try:
            composite.rerope_attention_composite(q, q, q, positions, positions, inv_freq, 0)
            raise AssertionError("window 0 accepted")
        except RuntimeError as error:
            assert "rerope_attention: window must be > 0" in str(error), error
print("layers ok")
"""


def test_the_op_layer_loads_bottom_up_without_the_package():
    allowed = {name: sorted(below) for name, below in OP_LAYER.items()}
    result = subprocess.run([sys.executable, "-c", _LAYERS_ALONE, str(PACKAGE), json.dumps(allowed)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "layers ok" in result.stdout, result.stderr[-3000:]


# Modules that ask a method its facts (issue 58, item 3): through the method (an attribute, ``two_tables``,
# ``is_plain``, ``long_table``) or the registry, never ``isinstance`` / ``type(...) is`` of a method class, and never a
# rope type or llama.cpp ``rope.scaling.type`` name compared as a string (llama.cpp's names are llamacpp.SCALING_TYPES).
# Every module but the registry's asks a method's facts of the method (an attribute, the registry), never of its
# class or a rope type string; each engine's own names live in one table of its adapter (llamacpp.SCALING_TYPES,
# vllm.rotary.VLLM_OWN_NTK).
REGISTRY_MODULES = {"scaling", "scaling_registry", "scaling_checks", "scaling_plain", "scaling_ntk", "scaling_yarn",
                    "scaling_llama3_longrope", "scaling_grok"}
# Comparisons with a string that is a rope type's name by coincidence, each with why.
NAME_COINCIDENCES = {
    ("check", "isa == 'default'"): "a CPU instruction set (torch's ATEN_CPU_CAPABILITY), not a rope type",
    ("cli.methods", "option.field != 'resonance'"): "a dataclass field's name (the resonance flag), not a rope type",
}


def test_method_facts_are_asked_of_the_method():
    from ropescale import llamacpp, scaling

    classes = {cls.__name__ for cls in scaling.METHODS.values()}
    names = set(scaling.table_type_names()) | set(llamacpp.SCALING_TYPES.values())
    modules = _package_modules()
    found = []

    def method_classes(node):  # scaling.YaRN, scaling_lib.Default: a method class reached through the registry module
        return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                and n.value.id in ("scaling", "scaling_lib") and n.attr in classes}

    for module in sorted(set(modules) - REGISTRY_MODULES):
        for node in ast.walk(modules[module]):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
                if method_classes(node.args[1]):
                    found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Compare):
                if (module, ast.unparse(node)) in NAME_COINCIDENCES:
                    continue
                operands = [node.left, *node.comparators]
                values = [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o])]
                strings = {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
                is_class = any(method_classes(o) for o in operands) and any(isinstance(op, (ast.Is, ast.IsNot))
                                                                         for op in node.ops)
                if strings & names or is_class:
                    found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "method facts asked by class or by name:\n" + "\n".join(found)
