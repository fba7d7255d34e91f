"""The documented public surface exists (issue 42, item 8).

Public names were renamed or removed without a word to users, while README and DESIGN went on naming
them. These tests guard three things:
- every ropescale name that README.md and the docs/ pages (DESIGN among them) write in code resolves. That
  covers dotted names in inline code and in ```python blocks (`ops.yarn_inv_freq`, `ropescale.hf.patch`,
  `torch.ops.ropescale.<op>`), the ropescale imports of those blocks, the op schemas of DESIGN's "C++ ops"
  list and the bare names of its "Python: import ropescale" list;
- every name in a module's `__all__` exists;
- CHANGELOG.md stays true: what it lists as removed or renamed is gone, and what it names instead exists.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# README and the documentation site (docs/, DESIGN among its pages: the text README held moved there, issue 58).
DOCS = ("README.md", "docs/DESIGN.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")
                                           if p.name != "DESIGN.md"))
PACKAGE = ROOT / "python" / "ropescale"

# The short module names the docs use for ropescale's modules (`from ropescale import ops, scaling`).
# vLLM's own names (`vllm.general_plugins`) are not ropescale's: only `ropescale.vllm...` is checked.
ALIASES = ("ops", "scaling", "hf", "config", "serving", "cache", "sharding", "rerope", "evaluate", "posgen",
           "plots", "check", "realmodel")
# A dotted name that starts at ropescale, one of its modules, or its op namespace. A name inside a longer
# chain (`model.config.x`) or a path (`ropescale/hf/architectures.py`) is someone else's.
CHAIN = re.compile(r"(?<![\w./\\-])((?:torch\.ops\.ropescale|ropescale|" + "|".join(ALIASES) +
                   r")(?:\.[A-Za-z_]\w*)+)(?![\w/])")
FILE_SUFFIXES = {"py", "md", "json", "toml", "txt", "cpp", "cu", "cuh", "h", "png", "sh", "gguf"}
# Inline code: one span, which may wrap onto the next line but never crosses a paragraph.
SPAN = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")
FENCE = re.compile(r"^[ \t]*```[ \t]*(\S*)")
# Another library's name just before a span means that the span is that library's name (transformers' `Cache`).
OTHER_LIBRARIES = {"transformers", "torch", "pytorch", "vllm", "vllm's", "flashinfer", "transformers'"}
# The submodules of ropescale.vllm and ropescale.sglang import their engine; the packages import without it.
ENGINE_SUBMODULES = {engine: tuple(f"ropescale.{engine}.{m.name}"
                                   for m in pkgutil.iter_modules([str(PACKAGE / engine)]))
                     for engine in ("vllm", "sglang")}
INSTALLED = {engine: importlib.util.find_spec(engine) is not None for engine in ENGINE_SUBMODULES}


@dataclasses.dataclass(frozen=True)
class Mention:
    where: str  # file:line
    name: str  # as written
    path: str  # the full dotted path it means
    kind: str = "name"  # "name", "import", "op", "bare" or "syntax"
    modules: tuple[str, ...] = ()  # "bare": the modules of its list entry

    def __str__(self):
        return f"{self.where}: `{self.name}`" + ("" if self.name == self.path else f" ({self.path})")


def _full(name: str) -> str:
    root = name.split(".", 1)[0]
    return f"ropescale.{name}" if root in ALIASES else name


def _chains(text: str, where, shadowed=frozenset()) -> list[Mention]:
    found = []
    for match in CHAIN.finditer(text):
        name = match.group(1)
        parts = name.split(".")
        if parts[-1] in FILE_SUFFIXES or any(p.startswith("_") for p in parts) or parts[0] in shadowed:
            continue  # a file name, a private name, or a variable of the example (`cache = PreRopeCache()`)
        found.append(Mention(where(match.start(1)), name, _full(name)))
    return found


def _split_fences(path: Path):
    """(the text with fenced blocks blanked out, keeping line numbers; [(language, first line, code)])."""
    lines = path.read_text().split("\n")
    prose, blocks, block = [], [], None
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if fence and block is None:
            block = (fence.group(1).lower(), number + 1, [])
            prose.append("")
        elif fence:
            blocks.append((block[0], block[1], "\n".join(block[2])))
            block = None
            prose.append("")
        elif block is not None:
            block[2].append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def _line_of(text: str, rel: str):
    return lambda offset: f"{rel}:{text.count(chr(10), 0, offset) + 1}"


def _section(text: str, heading: str) -> tuple[int, str]:
    """(the offset of the section under ``heading``, its text up to the next heading)."""
    start = text.index(heading)
    start = text.index("\n", start) + 1
    following = re.compile(r"^#{1,6} ", re.M).search(text, start)
    return start, text[start:following.start() if following else len(text)]


def _python_block(code: str, rel: str, first: int) -> list[Mention]:
    def where(offset):
        return f"{rel}:{first + code.count(chr(10), 0, offset)}"

    try:
        tree = ast.parse(code)
    except SyntaxError as error:
        return [Mention(f"{rel}:{first + (error.lineno or 1) - 1}", "the python block", "", "syntax")]
    # Names the example binds are its own variables, not ropescale's modules.
    shadowed = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    shadowed |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
                 for a in (*n.posonlyargs, *n.args, *n.kwonlyargs)}
    found = _chains(code, where, frozenset(shadowed))
    for node in ast.walk(tree):
        at = f"{rel}:{first + node.lineno - 1}" if hasattr(node, "lineno") else ""
        if isinstance(node, ast.Import):  # only ropescale's: `from vllm import LLM` is vLLM's to keep
            found += [Mention(at, f"import {a.name}", a.name, "import") for a in node.names
                      if a.name.split(".")[0] == "ropescale"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ropescale":
            found += [Mention(at, f"from {node.module} import {a.name}", f"{node.module}.{a.name}", "import")
                      for a in node.names]
    return found


def _op_schemas(text: str, rel: str) -> list[Mention]:
    """DESIGN's "C++ ops" list: each schema (`name(args) -> ret`, or `name(...)` where it elides them)."""
    start, section = _section(text, "### C++ ops")
    where = _line_of(text, rel)
    found = []
    for span in SPAN.finditer(section):
        schema = re.match(r"([a-z_]\w*(?:\.\w+)?)\((.*)\)", span.group(1), re.S)
        if schema and ("->" in span.group(1) or schema.group(2) == "..."):
            name = schema.group(1)
            found.append(Mention(where(start + span.start(1)), name, f"torch.ops.ropescale.{name}", "op"))
    return found


def _python_list(text: str, rel: str) -> list[Mention]:
    """DESIGN's "Python: import ropescale" list: the bare names each entry gives for its module(s)."""
    start, section = _section(text, "### Python: `import ropescale`")
    where = _line_of(text, rel)
    found = []
    for entry in re.finditer(r"^- .*?(?=^- |\Z)", section, re.M | re.S):
        offset = start + entry.start()
        modules = tuple(m.group(1) for m in re.finditer(r"`(ropescale(?:\.\w+)+)`", entry.group(0)))
        for span in SPAN.finditer(entry.group(0)):
            bare = re.fullmatch(r"@?([A-Za-z_]\w*)(?:\(.*\)|: *\w+)?", span.group(1), re.S)
            before = entry.group(0)[:span.start()].split()
            if not bare or (before and before[-1].lower() in OTHER_LIBRARIES):
                continue
            found.append(Mention(where(offset + span.start(1)), span.group(1), bare.group(1), "bare", modules))
    return found


def documented() -> list[Mention]:
    found = []
    for rel in DOCS:
        path = ROOT / rel
        text = path.read_text()
        prose, blocks = _split_fences(path)
        where = _line_of(prose, rel)
        for span in SPAN.finditer(prose):
            found += _chains(span.group(1), lambda offset, s=span: where(s.start(1) + offset))
        for language, first, code in blocks:
            if language in ("python", "py"):
                found += _python_block(code, rel, first)
        if rel.endswith("DESIGN.md"):
            found += _op_schemas(text, rel) + _python_list(text, rel)
    # In file order, so that a failure reads down each file.
    return sorted(found, key=lambda m: (DOCS.index(m.where.rsplit(":", 1)[0]), int(m.where.rsplit(":", 1)[1])))


def _member(owner, name: str):
    """``owner.name`` where ``owner`` is a class or a module. A dataclass field with no default counts too
    (`PreRopePlan.method`): it has no class attribute, so the walk continues at the field's type."""
    if hasattr(owner, name):
        return True, getattr(owner, name)
    if inspect.ismodule(owner) and hasattr(owner, "__path__"):  # a package (not torch.ops' namespaces)
        try:
            return True, importlib.import_module(f"{owner.__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{owner.__name__}.{name}":
                raise
            return False, None
    fields = getattr(owner, "__dataclass_fields__", {}) if inspect.isclass(owner) else {}
    if name in fields:
        kind = fields[name].type
        return True, kind if inspect.isclass(kind) else None
    return False, None


def resolve(path: str) -> str | None:
    """None when ``path`` resolves, attribute by attribute from its top module, importing submodules as
    ``import`` would. Otherwise, the reason it does not."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if obj is None:
            return f"{'.'.join(parts[:i])} is a field whose type cannot be followed to {part!r}"
        try:
            ok, obj = _member(obj, part)
        except ImportError as error:
            return f"importing {'.'.join(parts[:i + 1])} fails: {error}"
        if not ok:
            return f"{'.'.join(parts[:i])} has no attribute {part!r}"
    return None


def _rope_type_values() -> set[str]:
    # The rope type names and prefixes a list entry may give as values (`resonance_yarn`, `rerope_`).
    from ropescale import scaling
    prefixes = {v for k, v in vars(scaling.RopeType).items() if k.isupper() and isinstance(v, str)}
    return set(scaling.table_type_names()) | set(scaling.ropescale_rope_types()) | prefixes


def _resolve_bare(mention: Mention) -> str | None:
    if mention.path == "ropescale":
        return None
    reasons = []
    for module_name in mention.modules:
        if resolve(module_name) is not None:
            reasons.append(f"{module_name} (which does not import)")
            continue
        module = importlib.import_module(module_name)
        if resolve(f"{module_name}.{mention.path}") is None:
            return None
        # Something its classes have (`inv_freq(seq_len=None)`, `attention_factor` of the scaling methods).
        public = getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")])
        classes = [getattr(module, n) for n in public if inspect.isclass(getattr(module, n, None))]
        if any(_member(c, mention.path)[0] for c in classes):
            return None
        reasons.append(module_name)
    if mention.path in _rope_type_values():
        return None
    return f"not in {', '.join(reasons) or 'any module of its entry'}, its classes, or the rope type names"


def _check(mention: Mention) -> str | None:
    if mention.kind == "syntax":
        return "does not parse as Python"
    if mention.kind == "bare":
        return _resolve_bare(mention)
    if mention.kind == "import" and "." in mention.path:
        # `from ropescale.cache import PreRopeCache`: the module must import and hold the name
        module, name = mention.path.rsplit(".", 1)
        if mention.name.startswith("from "):
            try:
                imported = importlib.import_module(module)
            except ImportError as error:
                return f"importing {module} fails: {error}"
            return None if _member(imported, name)[0] else f"{module} has no {name!r}"
    return resolve(mention.path)


def _engine_of(mention: Mention) -> str | None:
    """The engine a documented name needs imported (its module is one of ropescale.vllm's or ropescale.sglang's
    submodules), or None."""
    for engine, submodules in ENGINE_SUBMODULES.items():
        if mention.path.startswith(submodules) or any(m.startswith(submodules) for m in mention.modules):
            return engine
    return None


def _unresolved(mentions) -> list[str]:
    return [f"{m}: {why}" for m in mentions if (why := _check(m)) is not None]


def test_the_extraction_finds_the_documented_surface():
    # Guards the parser itself: a regex that stops matching would pass every test below with nothing checked.
    paths = {m.path for m in documented()}
    for expected in ("ropescale.ops.yarn_inv_freq", "ropescale.scaling.YaRN", "ropescale.hf.patch",
                     "ropescale.hf.request", "ropescale.config.served_length_value", "ropescale.cache.PreRopeCache",
                     "torch.ops.ropescale.yarn_inv_freq", "torch.ops.ropescale.rerope_attention_paged.workspace",
                     "ropescale.serving.PreRopePlan.attention_arguments", "PreRopePlan", "needs_pre_rope",
                     "ropescale.vllm"):
        assert expected in paths, expected
    # Variables of the examples and other libraries' names are not ropescale's.
    assert not {"ropescale.cache.append", "ropescale.config._attn_implementation", "ropescale.hf.Cache",
                "Cache"} & paths


def test_documented_names_resolve():
    mentions = [m for m in documented() if _engine_of(m) is None]
    unresolved = _unresolved(mentions)
    assert not unresolved, (f"{len(unresolved)} documented name(s) do not resolve (fix the docs, or the code, "
                            "and say so in CHANGELOG.md):\n" + "\n".join(unresolved))


@pytest.mark.parametrize("engine", list(ENGINE_SUBMODULES))
def test_documented_engine_names_resolve(engine):
    if not INSTALLED[engine]:
        pytest.skip(f"ropescale.{engine}'s submodules import {engine}, which is not installed (its leg checks them)")
    unresolved = _unresolved([m for m in documented() if _engine_of(m) == engine])
    assert not unresolved, f"documented name(s) under ropescale.{engine} do not resolve:\n" + "\n".join(unresolved)


def _modules_with_all() -> list[str]:
    # Found from the sources, so that collecting the tests imports nothing.
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if any(p.startswith("_") for p in parts):  # private modules (and __main__, which runs the command)
            continue
        assigned = [t for node in ast.parse(path.read_text()).body if isinstance(node, ast.Assign)
                    for t in node.targets]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in assigned):
            names.append(".".join(parts))
    return names


@pytest.mark.parametrize("module_name", _modules_with_all())
def test_every_name_in_all_exists(module_name):
    for engine, submodules in ENGINE_SUBMODULES.items():
        if module_name.startswith(submodules) and not INSTALLED[engine]:
            pytest.skip(f"imports {engine}, which is not installed")
    module = importlib.import_module(module_name)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names what the module lacks: {missing}"
    assert len(set(module.__all__)) == len(module.__all__), f"{module_name}.__all__ repeats a name"


def _changelog_entries(kind: str) -> list[tuple[str, str]]:
    """(file:line, entry text) for each bullet under every ``### kind`` of CHANGELOG.md."""
    text = (ROOT / "CHANGELOG.md").read_text()
    entries = []
    for section in re.finditer(rf"^### {kind}\n(.*?)(?=^#{{2,3}} |\Z)", text, re.M | re.S):
        for entry in re.finditer(r"^- .*?(?=^- |\Z)", section.group(1), re.M | re.S):
            line = text.count("\n", 0, section.start(1) + entry.start()) + 1
            entries.append((f"CHANGELOG.md:{line}", entry.group(0)))
    return entries


def _split_entry(entry: str, separator: str) -> tuple[str, str] | None:
    """The entry before and after the first ``separator`` outside code spans (None where there is none)."""
    outside = re.sub(r"`[^`]*`", lambda m: "\0" * len(m.group(0)), entry)
    at = outside.find(separator)
    return None if at < 0 else (entry[:at], entry[at + len(separator):])


def _names(text: str) -> list[str]:
    return [m.group(1) for span in SPAN.finditer(text) for m in CHAIN.finditer(span.group(1))]


def _still_defined(path: str) -> bool:
    """Whether ``path`` still exists. A class member counts only where the class itself defines it: a removed
    override (`scaling.DynamicNTK.to_hf`) leaves the base class's method, which is its replacement."""
    owner_path, name = _full(path).rsplit(".", 1)
    if resolve(owner_path) is not None:
        return False
    owner = importlib.import_module(owner_path.split(".")[0])
    for part in owner_path.split(".")[1:]:
        owner = _member(owner, part)[1]
    if inspect.isclass(owner):
        return name in vars(owner) or name in vars(owner).get("__annotations__", {})
    return _member(owner, name)[0]


def test_changelog_removed_and_renamed_names_are_gone_and_their_replacements_exist():
    problems, gone_and_instead = [], []  # (where, (the names that are gone, the text naming what to use))
    for where, entry in _changelog_entries("Changed"):
        split = _split_entry(entry, " → ")
        if split is not None:  # a rename; the other Changed entries say how something behaves now
            gone_and_instead.append((where, split))
    renames = len(gone_and_instead)
    for where, entry in _changelog_entries("Removed"):
        split = _split_entry(entry, ": ")
        if split is None:
            problems.append(f"{where}: a Removed entry is written `name` (commit): what to use instead")
        else:
            gone_and_instead.append((where, split))
    assert renames and len(gone_and_instead) > renames, \
        "CHANGELOG.md lost its Removed or renamed Changed entries (or their format)"
    for where, (old, new) in gone_and_instead:
        if not _names(old):
            problems.append(f"{where}: no ropescale name before the separator: {old.strip()!r}")
        problems += [f"{where}: `{name}` is listed as gone but still exists" for name in _names(old)
                     if _still_defined(name)]
        problems += [f"{where}: `{name}` is named as what to use, but {why}" for name in _names(new)
                     if (why := resolve(_full(name))) is not None]
    assert not problems, "CHANGELOG.md is not true of the code:\n" + "\n".join(problems)

