"""Every module sits on the floor of what it is: no import upward, no import circle.

The imports are read from the source (`ast`), not from a running process, so an import
inside a function counts as much as one at the top: module-level, function-level and
relative imports, `from P import name` as the module `P.name` where that is a module, and
`importlib.import_module` of a constant or an f-string (an f-string counts as an import of
every module under its constant prefix). Importing `a.b.c` also runs the package `a.b`,
so the floor check counts `a.b` too; the roots (`specsamp`, `pipelines`, `tools`) are
left out of that, since Python runs a root before any of its modules in every process.

The floors, lowest first; a module imports its own floor and those below:

 0. foundations, which know no model: `errors`; `fs` (local paths and gs://, the cache);
    `compilation` (the compiled-program cache); `mesh` (devices); `reductions` (the
    batch-invariant sums every row's path uses, in quant, models and decoding alike);
    `prompts` (the prompt tables `prepare` writes and the pipeline reads).
 1. `quant`: stored weight formats and their native products (they sum with `reductions`).
 2. `models`: the Flax decoder, whose layers hold quant's weights.
 3. `loading`: checkpoints and tokenizers, turned into models and quant's weights.
 4. `decoding`: the loop; drafters load their models (`loading`), the cost curves ask
    the native kernels (`quant`) for the build their cache files are keyed by.
 5. built on the loop: `distill` (trains drafts from the target's outputs through the
    engine), `runconfig` (run configs, checked against decoding's settings and loading's
    formats), `testing` (the tiny synthetic checkpoints of tests and tools) and the root
    `specsamp` (the public API, re-exported from decoding).
 6. `analysis`: benchmarks, reports, the audit, evaluation, the weights agreement check;
    they drive the generator and read run configs and distill's corpus.
 7. `commands`: the CLI's subcommands, each a thin layer over analysis / decoding.
 8. `cli`: finds the commands (its own, by module name, and entry points).
 9. `pipelines`: the Beam pipeline, an application of the library. It plugs `specsamp
    run` into the CLI through the entry point group `specsamp.commands`
    (pyproject.toml), so nothing in `specsamp` names it, and `python -m
    pipelines.generate` goes through `cli.main`.
10. `tools`: scripts over everything.

Inside a floor, any direction is allowed, but no circle (lazy imports included: a circle
of function-level imports still ties the modules into one, and is a start-up order away
from an ImportError); a failure names one circle per strongly connected set of modules,
with the file and line of each import on it. One allowance, listed below with its
reason: `COMPUTED_IMPORTS`, modules that import a name they are given.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specsamp", "pipelines", "tools")

FLOORS = {
    "specsamp.errors": 0, "specsamp.fs": 0, "specsamp.compilation": 0, "specsamp.mesh": 0,
    "specsamp.reductions": 0, "specsamp.prompts": 0,
    "specsamp.quant": 1,
    "specsamp.models": 2,
    "specsamp.loading": 3,
    "specsamp.decoding": 4,
    "specsamp.distill": 5, "specsamp.runconfig": 5, "specsamp.testing": 5,
    "specsamp.analysis": 6,
    "specsamp.commands": 7,
    "specsamp.cli": 8,
    "pipelines": 9,
    "tools": 10,
}
# The root package alone (the public API); its floor is not its modules' floor, so that a
# new top-level module needs a place of its own above.
ROOT_API, ROOT_API_FLOOR = "specsamp", 5

# Edges inside specsamp/decoding/ that close an import circle today, each (importer,
# imported). The engine branch restructures decoding; the lead empties this set after
# merging it. Nothing outside specsamp/decoding/ may be listed here.
# Modules allowed to import a name computed at run time, which this test cannot follow.
COMPUTED_IMPORTS = {
    # Beam ships the generator's loader to its workers as "module:function" (default
    # "specsamp:load_generator", below pipelines; the tests name loaders of their own).
    "pipelines.handler": "the generator loader named in the pipeline's arguments",
}


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of PACKAGES (a package by its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _owner(name: str, known) -> str | None:
    """The module `name` is, or the innermost known module it lies in (a name inside it)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(module: str, is_package: bool, node, known) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative: from the importing module's package, level - 1 up
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]


def _dynamic_names(module: str, node: ast.Call, known) -> list[str]:
    """importlib.import_module("a.b") -> [a.b]; f"a.b.{x}" -> every module under a.b."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return []
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = arg.values[0].value
        return [m for m in known if m.startswith(prefix)]
    assert module in COMPUTED_IMPORTS, (
        f"{module}: an import of a computed name ({ast.unparse(arg)}) cannot be checked; "
        "import a named module")
    return []


def import_graph(known: dict[str, Path]) -> dict[str, dict[str, int]]:
    """importer -> {imported module of `known`: first line}, every import in the file."""
    graph = {}
    for module, path in known.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = _imported_names(module, path.name == "__init__.py", node, known)
            elif isinstance(node, ast.Call):
                names = _dynamic_names(module, node, known)
            else:
                continue
            for name in names:
                target = _owner(name, known)
                if target and target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def floor(module: str) -> int:
    if module == ROOT_API:
        return ROOT_API_FLOOR
    owner = _owner(module, FLOORS)
    assert owner is not None, f"{module} has no floor: add it (or its package) to FLOORS"
    return FLOORS[owner]


def _runs(module: str) -> list[str]:
    """`module` and the packages an import of it runs, roots left out."""
    parts = module.split(".")
    return [module, *(".".join(parts[:i]) for i in range(len(parts) - 1, 1, -1))]


def upward_imports(graph, known) -> list[str]:
    bad = []
    for importer, edges in sorted(graph.items()):
        for imported, line in sorted(edges.items()):
            above = [ran for ran in _runs(imported) if ran in known and floor(ran) > floor(importer)]
            if above:
                bad.append(f"{known[importer].relative_to(ROOT)}:{line}: {importer} "
                           f"(floor {floor(importer)}) imports {above[0]} (floor {floor(above[0])})")
    return bad


def circles(graph) -> list[list[str]]:
    """Each strongly connected component of more than one module, as one circle through
    it (Tarjan's algorithm, then a path back to the start inside the component)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle_in(graph, component) for component in components]


def _circle_in(graph, component: set[str]) -> list[str]:
    """A shortest path start -> ... -> start inside `component` (breadth first)."""
    start = min(component)
    previous, frontier = {}, [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in component and w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle in the component {sorted(component)}")


def _describe(graph, known, circle) -> str:
    steps = [f"{v} -> {w} ({known[v].relative_to(ROOT)}:{graph[v][w]})"
             for v, w in zip(circle, circle[1:])]
    return "circle: " + ", ".join(steps)


def test_no_module_imports_above_its_floor():
    """Catches an import upward, e.g. `import pipelines` in specsamp/commands/, or the
    quant floor importing decoding, even inside a function."""
    known = modules()
    bad = upward_imports(import_graph(known), known)
    assert not bad, "imports above the importer's floor:\n" + "\n".join(bad)


def test_no_import_circle():
    """Catches a circle of imports (lazy ones too), e.g. a helper of decoding's K policy
    importing the continuous engine that imports it."""
    known = modules()
    graph = import_graph(known)
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(_describe(graph, known, c) for c in found)


def test_every_module_has_a_floor():
    """Catches a new package or top-level module that the floors above do not place."""
    unplaced = [m for m in modules() if m != ROOT_API and _owner(m, FLOORS) is None]
    assert not unplaced, f"no floor for {unplaced}: add them to FLOORS"
