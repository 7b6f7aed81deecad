"""What a benchmark result measures, as a fingerprint that moves of code do not change (benchmarks.report's staleness).

A result is stale when the code it measures behaves differently, not when that code moves. The measured code is
the files under the result's MEASURES paths (git pathspecs: a file, a folder, `:(exclude)path`), read either at a
commit or in the working tree, cut into units:

- a Python file: one unit per top-level statement (a function, an assignment, ...; a class is its header plus one
  unit per member), hashed from its syntax tree (`ast.dump`, without line numbers). Docstrings, comments,
  formatting, import lines and `if TYPE_CHECKING:` blocks are not part of it, and neither is the file a unit
  sits in;
- a TOML file: the parsed table (comments and layout do not count), named by its path;
- a shell script: its lines without comment lines and surrounding white space, named by its path;
- any other file: its bytes, named by its path.

The fingerprint is the multiset of the unit hashes. Moving a function or class to another measured file, reordering
definitions, rewording a docstring or a comment, reformatting, changing which module an import comes from, or
adding a plain new definition (a function, class, method or constant under a name the measured code did not have:
nothing runs it until a changed unit names it), or removing one that no measured code names any more (e.g. moved
out to a tool the benchmark does not run) leaves a result fresh. Changing any statement of a unit (a
constant, a call, a default, a branch), removing or renaming a unit, adding any other statement (a module-level
call, a definition that shadows an existing name or is registered by a decorator), or changing a config value
or a script line makes it stale. What it cannot see: an import that now names a different object of the same
name from outside the measured paths (code inside them is fingerprinted where it is defined).
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import tomllib
from collections import Counter
from pathlib import Path

Unit = tuple[str, str, bool]  # (label: "path", "path:name" or "path:Class.name", hash, a plain definition)

# Decorators that only wrap or describe a definition: a new definition decorated by anything else may register
# itself somewhere (an op, a plugin), so it counts as a change even when nothing names it yet.
_PLAIN_DECORATORS = {"dataclass", "property", "staticmethod", "classmethod", "contextmanager", "cache", "wraps"}


def _sha(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body and _is_docstring(body[0]):
            n.body = body[1:] or [ast.Pass()]
    return node


def _unit_name(node: ast.stmt) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return ",".join(ast.unparse(t) for t in targets)
    return type(node).__name__.lower()


def _plain_definition(node: ast.stmt) -> bool:
    """A statement that only binds a new name: a function or class (plainly decorated), or an assignment whose value
    calls nothing but dataclass fields. Adding one changes nothing until some other statement names it."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names = {ast.unparse(d.func if isinstance(d, ast.Call) else d).split(".")[-1] for d in node.decorator_list}
        return names <= _PLAIN_DECORATORS
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        calls = [c for c in ast.walk(node) if isinstance(c, ast.Call)]
        return all(ast.unparse(c.func).split(".")[-1] == "field" for c in calls)
    return False


def python_units(path: str, text: str) -> list[Unit]:
    """(label, hash, plain definition) of every unit of a Python file; a class is its header (name, bases,
    decorators) plus one unit per member statement (`Class.member`)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return [(path, _sha(text.encode()), False)]
    units = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) or _is_docstring(node):
            continue  # import lines; the module docstring (or a bare string)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue  # annotations only
        if isinstance(node, ast.ClassDef):
            members, node.body = node.body, [ast.Pass()]
            units.append((f"{path}:{node.name}", _sha(ast.dump(node).encode()), _plain_definition(node)))
            for member in members:
                if _is_docstring(member):
                    continue
                dump = ast.dump(_strip_docstrings(member))
                label = f"{path}:{node.name}.{_unit_name(member)}"
                units.append((label, _sha(f"{node.name}\0{dump}".encode()), _plain_definition(member)))
            continue
        dump = ast.dump(_strip_docstrings(node), include_attributes=False)
        units.append((f"{path}:{_unit_name(node)}", _sha(dump.encode()), _plain_definition(node)))
    return units


def referenced_names(text: str) -> set[str]:
    """Every identifier a Python file names (variables, attributes, imported names): what could call a definition."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).split(".")[-1])
            names.add(n.name.split(".")[-1])
    return names


def file_units(path: str, data: bytes) -> list[Unit]:
    """The units of one measured file (see the module docstring)."""
    if path.endswith(".py"):
        return python_units(path, data.decode("utf-8", "replace"))
    if path.endswith(".toml"):
        try:
            canonical = json.dumps(tomllib.loads(data.decode()), sort_keys=True, default=str)
            return [(path, _sha(f"{path}\0{canonical}".encode()), False)]
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            pass
    if path.endswith(".sh"):
        lines = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines()]
        kept = [ln for ln in lines if ln and not (ln.startswith("#") and not ln.startswith("#!"))]
        # #SBATCH lines are directives, not comments
        kept += [ln for ln in lines if ln.startswith("#SBATCH")]
        return [(path, _sha(f"{path}\0{chr(10).join(kept)}".encode()), False)]
    return [(path, _sha(path.encode() + b"\0" + data), False)]


def matches(path: str, specs: list[str]) -> bool:
    """Whether `path` is selected by the pathspecs (plain prefixes, folders ending in '/', '.', ':(exclude)x')."""

    def hit(spec: str) -> bool:
        spec = spec.rstrip("/")
        return spec in ("", ".") or path == spec or path.startswith(spec + "/")

    includes = [s for s in specs if not s.startswith(":(exclude)")]
    excludes = [s.removeprefix(":(exclude)") for s in specs if s.startswith(":(exclude)")]
    return any(hit(s) for s in includes) and not any(hit(s) for s in excludes)


class Fingerprinter:
    """Units of the measured files of one repository, at commits or in the working tree (cached by content)."""

    def __init__(self, repo: Path):
        self.repo = Path(repo)
        self._by_blob: dict[str, list[Unit]] = {}
        self._names: dict[str, set[str]] = {}
        self._trees: dict[str | None, dict[str, str]] = {}

    def _git(self, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=self.repo, capture_output=True, input=input)

    def _tree(self, commit: str | None) -> dict[str, str]:
        """path -> content key of every file at `commit` (None: the working tree, untracked files included)."""
        if commit is not None and commit in self._trees:  # (the working tree is listed anew every time)
            return self._trees[commit]
        if commit is None:
            proc = self._git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
            paths = [p for p in proc.stdout.decode().split("\0") if p and (self.repo / p).is_file()]
            tree = {p: f"file:{p}" for p in paths}
        else:
            proc = self._git("ls-tree", "-r", "-z", commit)
            if proc.returncode != 0:
                raise LookupError(proc.stderr.decode().strip()[:120])
            tree = {}
            for entry in proc.stdout.decode().split("\0"):
                if entry:
                    meta, path = entry.split("\t", 1)
                    mode, kind, blob = meta.split()
                    if kind == "blob":
                        tree[path] = blob
        self._trees[commit] = tree
        return tree

    def _read(self, path: str, key: str) -> tuple[str, bytes | None]:
        """(cache key, bytes or None when cached) of one file at a commit (blob key) or in the working tree."""
        if key.startswith("file:"):
            data = (self.repo / path).read_bytes()
            return _sha(b"blob\0" + path.encode() + b"\0" + data), data
        cache = f"{key}:{path}"
        return cache, (None if cache in self._by_blob else self._git("cat-file", "blob", key).stdout)

    def _units(self, path: str, key: str) -> list[Unit]:
        cache, data = self._read(path, key)
        if cache not in self._by_blob:
            self._by_blob[cache] = file_units(path, data)
            self._names[cache] = referenced_names(data.decode("utf-8", "replace")) if path.endswith(".py") else set()
        return self._by_blob[cache]

    def units(self, commit: str | None, specs: list[str]) -> Counter:
        """Counter of units over the files `specs` selects at `commit` (None: the working tree)."""
        out: Counter = Counter()
        for path, key in sorted(self._tree(commit).items()):
            if matches(path, specs):
                out.update(self._units(path, key))
        return out

    def names(self, commit: str | None, specs: list[str]) -> set[str]:
        """The identifiers named anywhere in the selected Python files at `commit` (after `units` read them)."""
        out: set[str] = set()
        for path, key in self._tree(commit).items():
            if matches(path, specs) and path.endswith(".py"):
                self._units(path, key)
                out |= self._names[self._read(path, key)[0]]
        return out

    def changed(self, commit: str, specs: list[str]) -> list[str]:
        """Labels of the units that make the working tree differ from `commit` ([]: the same behaviour). Units whose
        hash is on both sides (moved, reformatted, re-documented) do not count, and neither does a plain new
        definition under a name the measured code did not have, nor a plain definition removed (or moved out of
        the measured paths) that no measured code names any more: nothing can run either. LookupError when git
        does not know `commit`."""
        old, new = self.units(commit, specs), self.units(None, specs)
        old_hashes = Counter(h for (_, h, _), n in old.items() for _ in range(n))
        new_hashes = Counter(h for (_, h, _), n in new.items() for _ in range(n))
        removed, added = old_hashes - new_hashes, new_hashes - old_hashes
        old_names = {_name(label) for label, _, _ in old}
        named_now = self.names(None, specs) if removed else set()
        labels = {
            label
            for label, h, plain in old
            if h in removed and not (plain and _name(label).split(".")[-1] not in named_now)
        }
        labels |= {label for label, h, plain in new if h in added and not (plain and _name(label) not in old_names)}
        return sorted(labels)


def _name(label: str) -> str:
    """A unit's name wherever it sits: "Class.member" of "path:Class.member" (a file's own label is its path)."""
    return label.split(":", 1)[1] if ":" in label else label
