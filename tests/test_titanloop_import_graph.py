"""titanloop's modules import each other without a circle, counting imports inside functions too (issue 25).

A circle among modules works only while one of its imports sits inside a function, and breaks the day someone
moves it to the top. The graph below is read from the source (ast), so it sees function-level imports:
- `import titanloop.x` / `from titanloop.x import name`: an edge to titanloop.x.name when that is a module,
  else to titanloop.x;
- imports under `if TYPE_CHECKING:` count too: a circle of annotations is still a circle of knowledge (issue 37);
- an edge from a module to one of its own parent packages does not count (the package's __init__ runs before
  any of its submodules, whoever imports them).
A second test keeps function-level imports of titanloop's own modules to an explicit, justified list.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (ROOT / "titanloop").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_edges(mods: dict[str, Path]) -> dict[str, dict[str, tuple[int, bool]]]:
    """module -> {imported module: (line, inside a function)}."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, dict[str, tuple[int, bool]]] = {m: {} for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        in_function = {
            id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)
        }
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                dep = resolve(target) if target.startswith("titanloop") else None
                if dep and dep != mod and not mod.startswith(dep + "."):
                    edges[mod].setdefault(dep, (node.lineno, id(node) in in_function))
    return edges


def circles(edges) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_among_titanloop_modules():
    edges = import_edges(_modules())
    found = circles(edges)
    detail = [
        f"{a} -> {b} (line {edges[a][b][0]}{', in a function' if edges[a][b][1] else ''})"
        for comp in found
        for a in comp
        for b in edges[a]
        if b in comp
    ]
    assert not found, "import circle(s): " + "; ".join(detail)


def _toy_package(tmp_path, **sources: str) -> dict:
    """A package `titanloop` under tmp_path with the given modules (name -> source); its module -> path map."""
    pkg = tmp_path / "titanloop"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    mods = {"titanloop": pkg / "__init__.py"}
    for name, source in sources.items():
        (pkg / f"{name}.py").write_text(source)
        mods[f"titanloop.{name}"] = pkg / f"{name}.py"
    return mods


def test_the_checker_finds_a_circle_hidden_in_a_function(tmp_path):
    """The checker itself can fail: a two-module circle whose second import sits inside a function."""
    mods = _toy_package(
        tmp_path,
        a="from titanloop.b import g\n\ndef f():\n    return g()\n",
        b="def g():\n    from titanloop.a import f\n    return f\n",
    )
    edges = import_edges(mods)
    assert edges["titanloop.b"]["titanloop.a"][1] is True
    assert circles(edges) == [["titanloop.a", "titanloop.b"]]


def test_every_function_level_import_of_titanloop_says_why():
    """Imports of titanloop's own modules sit at the top of the module; one inside a function (an optional or
    heavy dependency, a CLI that must answer before torch loads) carries a one-line reason: a comment on its
    line or on the line above it."""
    missing = []
    for mod, path in sorted(_modules().items()):
        lines = path.read_text().split("\n")
        tree = ast.parse("\n".join(lines))
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(f):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("titanloop"):
                    here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                    if "#" not in here and not above.startswith("#") and not above.startswith("from titanloop"):
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not missing, f"function-level imports of titanloop modules without a reason: {missing}"


def test_no_module_below_the_trainer_imports_its_config():
    """The training config lists the sections; the code they configure lives below it and receives its own
    section, never the whole TrainConfig: no module outside titanloop.train imports titanloop.train.config."""
    edges = import_edges(_modules())
    offenders = [
        m for m, deps in edges.items() if "titanloop.train.config" in deps and not m.startswith("titanloop.train")
    ]
    assert not offenders, f"modules below the trainer importing titanloop.train.config: {offenders}"


def test_the_checker_counts_annotation_only_imports(tmp_path):
    mods = _toy_package(
        tmp_path,
        a="from titanloop.b import g\n",
        b="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from titanloop.a import f\n",
    )
    assert circles(import_edges(mods)) == [["titanloop.a", "titanloop.b"]]
