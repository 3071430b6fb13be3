"""The import structure: no cycles between modules, and every import goes down the layers (docs/architecture.md).

The check reads the source with `ast` and imports nothing. The modules are the .py files of the folders that
pyproject.toml's package-dir installs under `fedharness` (harness/, algorithms/, partitions/), under their
installed names. An import of module A names module B when A holds `import B`, `from B import x` or
`from P import B` (a submodule B of P); `from P import name`, where name is no submodule, names P. Imports at
module level and inside functions both count; imports under `if TYPE_CHECKING:` do not (they serve annotations
only and never run). Two readings keep packages sensible:

* Importing fedharness.a.b also runs fedharness/a/__init__.py first. That implicit step is not an edge: only
  the modules a file names are. So a package __init__ that imports its own submodules (a face, or a factory such
  as fedharness.problems.build_problem) forms no cycle with a submodule that imports its sibling.
* Imports by name at run time (importlib.import_module: the lazy exports of fedharness/__init__.py and
  fedharness/studies/reports/__init__.py) are not read.

Run `python tests/test_layers.py` for the whole picture: layers, counts, cycles, upward imports, and the
function-local imports of project modules, with the line of each.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import its own layer and the layers below; layers that share a rank ("parts" and
# "core") may not import each other. A name "x.*" covers the modules under package x that no exact name
# claims; an exact name wins over a pattern.
LAYERS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("base", 0, ("fedharness", "fedharness.errors", "fedharness.keys", "fedharness.contracts", "fedharness.settings",
                 "fedharness.base", "fedharness.base.*", "fedharness.results", "fedharness.results.*")),
    ("parts", 1, ("fedharness.algorithms", "fedharness.algorithms.*", "fedharness.partitions",
                  "fedharness.partitions.*", "fedharness.problems", "fedharness.problems.*", "fedharness.references",
                  "fedharness.references.*", "fedharness.extend", "fedharness.registry", "fedharness.registry.*")),
    ("core", 1, ("fedharness.core", "fedharness.core.*")),
    ("config", 2, ("fedharness.config", "fedharness.config.*")),
    ("assembly", 3, ("fedharness.assembly", "fedharness.assembly.*")),
    ("execution", 4, ("fedharness.backends", "fedharness.backends.*", "fedharness.sinks", "fedharness.sinks.*")),
    ("runs", 5, ("fedharness.runs", "fedharness.runs.*")),
    ("studies", 6, ("fedharness.studies", "fedharness.studies.*")),
    ("api", 7, ("fedharness.api",)),
    ("cli", 8, ("fedharness.cli",)),
)

# A folder's modules are one layer: the folder says where a module stands. The modules loose in harness/ (at most
# MAX_LOOSE) are the package, the vocabulary every layer shares, the registration calls, the API and the command.
FOLDERS: dict[str, str] = {
    "base": "base", "results": "base", "algorithms": "parts", "partitions": "parts", "problems": "parts",
    "references": "parts", "registry": "parts", "core": "core", "config": "config", "assembly": "assembly",
    "backends": "execution", "sinks": "execution", "runs": "runs", "studies": "studies",
}
MAX_LOOSE = 8


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module
    line: int
    local: bool  # inside a function

    def where(self) -> str:
        return f"{MODULES[self.source].relative_to(ROOT)}:{self.line}"


def package_dirs() -> dict[str, Path]:
    """Installed package name -> folder, from pyproject.toml's [tool.setuptools.package-dir]."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: ROOT / folder for name, folder in pyproject["tool"]["setuptools"]["package-dir"].items()}


def find_modules() -> dict[str, Path]:
    """Every module under its installed name; a folder mapped to its own package is read under that name only."""
    roots = package_dirs()
    out: dict[str, Path] = {}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = list(rel.parts)
            if not all(p.isidentifier() for p in parts):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            inner = [p for p, f in roots.items() if f != folder and f.is_relative_to(folder)
                     and path.is_relative_to(f)]
            if not inner:  # another package-dir entry claims the files below it
                out[name] = path
    return out


MODULES = find_modules()


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(module: str, node: ast.Import | ast.ImportFrom, package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from . import x, from ..a import b
        parts = module.split(".") if package else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join([*parts, *([base] if base else [])])
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), local)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in dict.fromkeys(_targets(module, child, package)):  # each module once a statement
                    while target not in MODULES and "." in target:  # `import fedharness.a.b.name`-like spellings
                        target = target.rsplit(".", 1)[0]
                    if target in MODULES and target != module:
                        found.append(Import(module, target, child.lineno, local))
                continue
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def import_graph() -> list[Import]:
    return [imp for module in MODULES for imp in imports_of(module)]


def layer_of(module: str) -> tuple[str, int] | None:
    best: tuple[int, str, int] | None = None  # (specificity, layer, rank)
    for name, rank, patterns in LAYERS:
        for pattern in patterns:
            if pattern == module:
                score = 10_000
            elif pattern.endswith(".*") and module.startswith(pattern[:-1]):
                score = len(pattern)
            else:
                continue
            if best is None or score > best[0]:
                best = (score, name, rank)
    return None if best is None else (best[1], best[2])


def upward(imports: list[Import]) -> list[Import]:
    """Imports from a layer to a higher one, or to another layer of the same rank."""
    out = []
    for imp in imports:
        if layer_of(imp.source) is None or layer_of(imp.target) is None:
            continue  # test_every_module_has_a_layer names it
        (src, src_rank), (dst, dst_rank) = layer_of(imp.source), layer_of(imp.target)
        if dst_rank > src_rank or (dst_rank == src_rank and dst != src):
            out.append(imp)
    return out


def cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(MODULES):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(imp: Import) -> str:
    return f"{imp.where()}: {imp.source} ({layer_of(imp.source)[0]}) -> {imp.target} ({layer_of(imp.target)[0]})" \
        + (" [inside a function]" if imp.local else "")


def test_the_package_dirs_hold_modules():
    assert {"fedharness", "fedharness.algorithms", "fedharness.partitions", "fedharness.core.engine"} <= set(MODULES)


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if layer_of(m) is None)
    assert not missing, "declare the layer of these modules in LAYERS (and docs/architecture.md): " + ", ".join(missing)


def test_no_import_cycles():
    imports = import_graph()
    found = cycles(imports)
    lines = []
    for component in found:
        lines.append("cycle: " + ", ".join(component))
        lines += ["  " + _describe(i) for i in imports if i.source in component and i.target in component]
    assert not found, "\n".join(lines)


def test_imports_go_down_the_layers():
    bad = upward(import_graph())
    assert not bad, f"{len(bad)} import(s) from a lower layer to a higher one (or across parts/core):\n" + \
        "\n".join("  " + _describe(i) for i in bad)


def folder_of(module: str) -> str | None:
    """The first folder below the namespace that holds the module (None: loose in harness/)."""
    rel = MODULES[module].relative_to(ROOT)  # harness/x.py, harness/core/engine.py, algorithms/samplers.py
    if rel.parts[0] != "harness":
        return rel.parts[0]
    return rel.parts[1] if len(rel.parts) > 2 else None


def test_a_modules_folder_is_its_layer():
    wrong = [f"{m} ({MODULES[m].relative_to(ROOT)}): folder {folder_of(m)}/ is layer {FOLDERS.get(folder_of(m))}, "
             f"the module is declared {layer_of(m)[0]}"
             for m in sorted(MODULES) if folder_of(m) is not None and FOLDERS.get(folder_of(m)) != layer_of(m)[0]]
    assert not wrong, "\n".join(wrong)


def test_few_modules_loose_in_harness():
    loose = sorted(m for m in MODULES if folder_of(m) is None)
    assert len(loose) <= MAX_LOOSE, f"{len(loose)} modules loose in harness/ (at most {MAX_LOOSE}): {loose}"


def function_local_imports() -> list[Import]:
    """Project modules imported inside functions: reported, not failed. What keeps one inside a function should
    be the cost of what it loads on a path that must stay light (the CLI's parser, an optional extra such as
    Ray), never a cycle: a cycle would fail test_no_import_cycles wherever the import stood."""
    return [i for i in import_graph() if i.local]


def report() -> str:
    imports = import_graph()
    local = function_local_imports()
    out = ["layers, lowest first (a module imports its own layer and lower ones; same rank: not each other):"]
    for name, rank, _ in LAYERS:
        members = sorted(m for m in MODULES if layer_of(m) == (name, rank))
        out.append(f"  {rank} {name:<10} {len(members):>3} modules: {', '.join(members)}")
    found, bad = cycles(imports), upward(imports)
    statements = {(i.source, i.line) for i in local}
    out.append(f"{len(MODULES)} modules, {len({(i.source, i.target) for i in imports})} module-to-module imports; "
               f"{len(found)} cycles; {len(bad)} upward imports; {len(statements)} function-local import statements "
               f"of project modules ({len(local)} imports)")
    out += ["cycle: " + ", ".join(c) for c in found]
    out += ["upward: " + _describe(i) for i in bad]
    out += ["local: " + _describe(i) for i in local]
    return "\n".join(out)


if __name__ == "__main__":
    print(report())
    sys.exit(0)


# The engine and its backends run every update stage the same way (core/stages.py): none of them may know a
# particular one. Words of the features that used to be wired in as flags (issue 37), matched in identifiers,
# attribute names, imported modules and string constants, never in comments or docstrings.
FEATURE_WORDS = ("privacy", "dp_", "clip", "noise", "attack", "byzantine", "adversary", "poison", "flip", "label",
                 "compress", "sparsif", "quantiz")
STAGE_FREE = ("fedharness.core", "fedharness.backends")


def feature_names(source: str, where: str) -> list[str]:
    """`where:line name` for each identifier, attribute, import or string constant of `source` (docstrings aside)
    that names a feature."""
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.arg)):
            names = [getattr(node, "name", None) or node.arg]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [getattr(node, "module", None) or "", *(a.name for a in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names = [node.value]
        else:
            continue
        found += [f"{where}:{getattr(node, 'lineno', 0)} {n}" for n in names
                  if any(w in n.lower() for w in FEATURE_WORDS)]
    return found


def test_the_engine_and_backends_name_no_update_feature():
    modules = [m for m in MODULES if m.startswith(STAGE_FREE)]
    assert len(modules) > 10
    assert [hit for m in modules for hit in feature_names(MODULES[m].read_text(), m)] == []


def test_the_feature_check_sees_a_flag_and_not_a_comment():
    """The engine before issue 37, two of its lines: a branch on `self.privacy` and an import of the attacks."""
    source = ('"""Mentions privacy in a docstring."""\nfrom fedharness.core.byzantine import forge_updates\n'
              'if self.privacy is not None:  # a comment on clip norms\n    plan.clip_norm = 1\n')
    assert feature_names(source, "engine") == ["engine:2 fedharness.core.byzantine", "engine:3 privacy",
                                               "engine:4 clip_norm"]


def test_the_contracts_name_nothing_above_base_not_even_for_annotations():
    """contracts is the ground floor (issue 37): under `if TYPE_CHECKING:` too, it imports no project module but
    the package itself and base/ (it used to name core's RoundPlan, ShardResult and RunOutcome there)."""
    tree = ast.parse(MODULES["fedharness.contracts"].read_text())
    named = {n.module if isinstance(n, ast.ImportFrom) else a.name
             for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names}
    project = {m for m in named if m and m.startswith("fedharness")}
    assert {m for m in project if not m.startswith("fedharness.base")} == set()


# The engine runs every cadence, speed, availability and staleness function the same way (issue 52): the options
# are parts chosen from their groups, so no module of harness/core names one. The names are the shipped options'
# (conf/<group>/*.yaml), matched as string constants outside docstrings: a comparison, a membership test or a
# dispatch table keyed by name all need one.
PROFILE_GROUPS = ("cadence", "speed", "availability", "staleness")
PROFILE_NAMES = frozenset(p.stem for g in PROFILE_GROUPS for p in (ROOT / "conf" / g).glob("*.yaml"))


def profile_names(source: str, where: str) -> list[str]:
    """`where:line name` for each string constant of `source` (docstrings aside) that is a shipped option's name."""
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [f"{where}:{node.lineno} {node.value}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and node.value in PROFILE_NAMES]


def test_the_core_compares_no_cadence_speed_or_availability_name():
    assert {"sync", "fedbuff", "fedasync", "lognormal", "duty_cycle", "poly"} <= PROFILE_NAMES
    modules = [m for m in MODULES if m.startswith("fedharness.core")]
    assert len(modules) > 10
    assert [hit for m in modules for hit in profile_names(MODULES[m].read_text(), m)] == []


def test_the_profile_check_sees_a_comparison_and_not_a_docstring():
    """The engine before issue 52, one of its lines: a branch on the asynchronous rule's mode."""
    source = ('"""Runs fedbuff and fedasync."""\nif self.rule.mode == "fedasync":\n    update = update + x\n'
              'speeds = {"lognormal": LognormalSpeeds}\n')
    assert profile_names(source, "engine") == ["engine:2 fedasync", "engine:4 lognormal"]


def test_the_engine_stays_a_loop():
    """Issue 52: the round's shape lives in the cadences (algorithms/cadences.py), the plan and counts in
    core/planning.py; the engine that calls them stays within 520 lines (it had grown to 750 around them)."""
    lines = len(MODULES["fedharness.core.engine"].read_text().splitlines())
    assert 300 < lines <= 520, lines
