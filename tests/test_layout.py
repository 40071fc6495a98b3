"""The package's layout rules, checked from the source alone (nothing is imported).

* **No import cycle inside ``asyncsample/``.** Edges are the imports a module runs when it is
  imported: module-level ``import`` and ``from ... import`` statements, including those inside
  module-level ``if``/``try``/``with`` blocks and class bodies, and ``from package import name``
  where ``name`` is a submodule. Imports under ``if TYPE_CHECKING:`` never count (they never
  run). Importing ``a.b.c`` is an edge to ``a.b.c`` only, not to the packages above it, so a
  package ``__init__`` that re-exports its modules is no cycle.
* **Nor through lazy or type-only imports.** An import inside a function, or under
  ``if TYPE_CHECKING:``, that closes a loop dodges the cycle at import time but keeps the two
  modules tied together: the second check counts those imports too.
* **Nor between folders.** Taken as one node each, the subpackages (``backends/``,
  ``inference/``, ``vector/``...) and the root's modules import each other without a cycle,
  counting lazy and type-only imports: a package sits wholly above or below each module it
  meets.
* **No module over** :data:`MAX_LINES` **lines**, except those in :data:`LONG_MODULES`, each with
  the reason it reads better whole.
* **Capabilities, not names**: outside ``asyncsample/backends/``, no ``isinstance`` on a concrete
  host or backend class (ask a protocol of :mod:`asyncsample.backends.base`) and no comparison
  with a backend's name (ask its ``Traits`` in ``backends.TABLE``).
* **No private members across objects**: ``x._name`` only for ``x`` in ``self``, ``cls`` or
  ``super()``. Our own modules' private functions are private too (``mod._f`` is refused); a
  third-party private we cannot avoid is listed in :data:`FOREIGN_PRIVATES` with the reason.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "asyncsample"
#: The most lines a module may have (unless allowed below).
MAX_LINES = 800

#: Modules allowed over MAX_LINES: path relative to the package -> why it reads better whole.
#: Add an entry only for one responsibility that would lose by being split, and say which.
LONG_MODULES: dict[str, str] = {}


#: Third-party private names we read, by (module, expression) -> why there is no public way.
FOREIGN_PRIVATES: dict[tuple[str, str], str] = {
    ("async_env.py", "env._max_episode_steps"): "gymnasium's TimeLimit keeps its limit only there",
    ("backends/_transport.py", "sharedctypes._new_value"): "a RawValue without zeroing its memory",
    ("backends/_host_main.py", "os._exit"): "documented: leave a forked host at once",
    ("backends/_procs.py", "forkserver._forkserver"): "the forkserver's pid (no public access)",
    ("backends/_procs.py", "resource_tracker._resource_tracker"): "its pid (no public access)",
    ("backends/_watchdog.py", "sys._current_frames"): "documented; another thread's stack",
    ("vector/env.py", "_GymVectorEnv._add_info"): "gymnasium's own vector-info builder",
    ("vector/portal.py", "asyncio._get_running_loop"): "documented; no warning outside a loop",
}


def module_name(path: Path) -> str:
    """``asyncsample/backends/process.py`` -> ``asyncsample.backends.process``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


class _ImportFinder(ast.NodeVisitor):
    """Collects the import statements of a module, skipping, unless ``lazy``, function bodies
    and ``if TYPE_CHECKING:`` bodies (they do not run at import time)."""

    def __init__(self, lazy: bool) -> None:
        self.lazy = lazy
        self.found: list[ast.Import | ast.ImportFrom] = []

    def visit_If(self, node: ast.If) -> None:
        if self.lazy or not _is_type_checking(node.test):
            for child in node.body:
                self.visit(child)
        for child in node.orelse:
            self.visit(child)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if self.lazy:
            self.generic_visit(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        if self.lazy:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append(node)


def imports(name: str, path: Path, known: Mapping[str, object], lazy: bool = False) -> set[str]:
    """The package modules that module ``name`` imports (see the module docstring).

    Args:
        name: the module's dotted name.
        path: its source file.
        known: the package's modules by dotted name.
        lazy: count imports inside functions and under ``if TYPE_CHECKING:`` too.
    """
    finder = _ImportFinder(lazy)
    finder.visit(ast.parse(path.read_text(), str(path)))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in finder.found:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
            continue
        if node.level:
            base = name.split(".")
            # From a package's __init__, level 1 is the package itself.
            drop = node.level - 1 if is_package else node.level
            base = base[: len(base) - drop] if drop else base
            parent = ".".join([*base, node.module] if node.module else base)
        else:
            parent = node.module or ""
        for alias in node.names:
            submodule = f"{parent}.{alias.name}"
            if submodule in known:
                out.add(submodule)
            elif parent in known:
                out.add(parent)
    out.discard(name)
    return out


def import_graph(lazy: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports at import time (and, if ``lazy``, later or
    for the type checker only)."""
    known = modules()
    return {name: imports(name, path, known, lazy) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module, as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the package is small enough to recurse
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(c)) for c in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module of a strongly connected component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # cannot happen in a component


def describe(found: list[list[str]]) -> str:
    return "\n".join("  " + " -> ".join(cycle) for cycle in found)


def test_no_import_cycle_inside_the_package() -> None:
    found = cycles(import_graph())
    assert not found, (
        f"import cycles inside asyncsample/ (module-level imports):\n{describe(found)}"
    )


def test_no_import_cycle_through_lazy_or_type_checking_imports() -> None:
    found = cycles(import_graph(lazy=True))
    assert not found, (
        "import cycles inside asyncsample/ closed by imports inside functions or under "
        f"TYPE_CHECKING:\n{describe(found)}"
    )


def folder_of(name: str) -> str:
    """The node ``name`` belongs to at folder level: its top subpackage
    (``asyncsample.backends``), or the module itself for the root's modules."""
    parts = name.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return ".".join(parts[:2])
    return name


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with each subpackage's modules merged into one node (see :func:`folder_of`)."""
    folders: dict[str, set[str]] = {}
    for name, targets in graph.items():
        node = folders.setdefault(folder_of(name), set())
        for target in targets:
            folders.setdefault(folder_of(target), set())
            if folder_of(target) != folder_of(name):
                node.add(folder_of(target))
    return folders


def test_folder_graph_merges_a_subpackage_into_one_node() -> None:
    graph = {
        "asyncsample.backends.aio": {"asyncsample._engine"},
        "asyncsample._engine": {"asyncsample.backends.base"},
        "asyncsample.backends.base": set(),
    }
    assert cycles(graph) == []  # module by module: no cycle
    assert cycles(folder_graph(graph)) == [
        ["asyncsample._engine", "asyncsample.backends", "asyncsample._engine"]
    ]


def test_no_import_cycle_between_folders() -> None:
    found = cycles(folder_graph(import_graph(lazy=True)))
    assert not found, (
        "import cycles between asyncsample/'s subpackages and root modules (each subpackage one "
        f"node; lazy and type-only imports count):\n{describe(found)}"
    )


def test_no_module_is_too_long() -> None:
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE))
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and relative not in LONG_MODULES:
            long[relative] = n
    assert not long, (
        f"modules over {MAX_LINES} lines (split them, or allow them in LONG_MODULES with the "
        "reason they read better whole):\n"
        + "\n".join(f"  asyncsample/{p}: {n} lines" for p, n in long.items())
    )


def test_the_allowed_long_modules_exist() -> None:
    missing = [p for p in LONG_MODULES if not (PACKAGE / p).is_file()]
    assert not missing, f"LONG_MODULES names modules that do not exist: {missing}"


def backend_names() -> set[str]:
    """The backends' names: the first argument of each ``Traits(...)`` in ``backends.TABLE``."""
    tree = ast.parse((PACKAGE / "backends" / "__init__.py").read_text())
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "Traits"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


def concrete_hosts() -> set[str]:
    """The classes of ``asyncsample/backends/`` named ``...Host`` or ``...Backend`` that are not
    protocols."""
    found = set()
    for path in (PACKAGE / "backends").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Host", "Backend")):
                if not any(ast.unparse(base).endswith("Protocol") for base in node.bases):
                    found.add(node.name)
    return found


def seam_violations(source: str, names: set[str], hosts: set[str]) -> set[str]:
    """The expressions of ``source`` that break the seam rules (see the module docstring)."""
    tree = ast.parse(source)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            owner = node.value
            own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            own = own or (isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super")
            if not own and not node.attr.startswith("__"):
                found.add(ast.unparse(node))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("isinstance", "issubclass"):
            if len(node.args) == 2:
                classes = node.args[1]
                parts = classes.elts if isinstance(classes, ast.Tuple) else [classes]
                if any(ast.unparse(c).split(".")[-1] in hosts for c in parts):
                    found.add(ast.unparse(node))
        elif isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                named = any(isinstance(i, ast.Constant) and i.value in names for i in items)
                if named or ast.unparse(side).endswith("BACKENDS"):
                    found.add(ast.unparse(node))
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant):
            if node.value.value in names:
                found.add(f"case {node.value.value!r}")
    return found


def test_capabilities_not_names_and_no_private_members_across_objects() -> None:
    names, hosts = backend_names(), concrete_hosts()
    assert {"process", "local"} <= names and {"ProcessHost", "LocalBackend"} <= hosts
    broken = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE))
        found = seam_violations(path.read_text(), names, hosts)
        if relative.startswith("backends/"):  # the backends' own classes and names: private
            found = {f for f in found if "._" in f}
        found -= {expr for (module, expr) in FOREIGN_PRIVATES if module == relative}
        if found:
            broken[relative] = sorted(found)
    assert not broken, (
        "backend names, concrete host classes or other objects' private members used (ask a "
        "protocol or the backend's Traits; make the member public):\n"
        + "\n".join(f"  asyncsample/{p}: {', '.join(f)}" for p, f in broken.items())
    )


def test_the_known_violations_are_still_there() -> None:
    """An entry of FOREIGN_PRIVATES that was fixed is removed."""
    names, hosts = backend_names(), concrete_hosts()
    listed = list(FOREIGN_PRIVATES)
    stale = [
        (module, expr)
        for module, expr in listed
        if expr not in seam_violations((PACKAGE / module).read_text(), names, hosts)
    ]
    assert not stale, f"listed but gone (remove them): {stale}"


# -- the checker itself, on made-up sources ------------------------------------------------------


def test_the_checker_sees_the_imports_that_run_and_skips_the_others(tmp_path: Path) -> None:
    source = """
from __future__ import annotations
import os
from typing import TYPE_CHECKING
from asyncsample import errors
from asyncsample.backends import base
from . import seeding
from .backends.local import LocalHost
if TYPE_CHECKING:
    from asyncsample import sampler
else:
    import asyncsample.stats
try:
    from asyncsample import agent
except ImportError:
    from asyncsample import env_update

def lazy():
    from asyncsample import vector
"""
    path = tmp_path / "probe.py"
    path.write_text(source)
    known = {
        n: PACKAGE
        for n in [
            "asyncsample",
            "asyncsample.errors",
            "asyncsample.backends",
            "asyncsample.backends.base",
            "asyncsample.backends.local",
            "asyncsample.seeding",
            "asyncsample.sampler",
            "asyncsample.stats",
            "asyncsample.agent",
            "asyncsample.env_update",
            "asyncsample.vector",
        ]
    }
    assert imports("asyncsample.probe", path, known) == {
        "asyncsample.errors",
        "asyncsample.backends.base",
        "asyncsample.seeding",
        "asyncsample.backends.local",
        "asyncsample.stats",
        "asyncsample.agent",
        "asyncsample.env_update",
    }
    lazy = imports("asyncsample.probe", path, known, lazy=True)
    assert {"asyncsample.vector", "asyncsample.sampler"} <= lazy  # later, or for mypy only


def test_the_checker_finds_a_cycle_and_names_it() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_seam_checker_finds_names_hosts_and_private_members() -> None:
    source = """
class A:
    def f(self, other, backend, host):
        self._mine, cls._ours, super()._theirs  # own: fine
        other._x  # another object's private member
        mod._helper()  # a module's private function
        backend == "process"
        backend in ("asyncio", "thread")
        name in LANE_BACKENDS
        backend == "processes"  # not a backend's name
        isinstance(host, ProcessHost)
        isinstance(host, (int, base.LocalHost))
        isinstance(host, EnvHost)  # a protocol: fine
        match backend:
            case "ray":
                pass
"""
    found = seam_violations(
        source, {"process", "asyncio", "thread", "ray"}, {"ProcessHost", "LocalHost"}
    )
    assert found == {
        "other._x",
        "mod._helper",
        "backend == 'process'",
        "backend in ('asyncio', 'thread')",
        "name in LANE_BACKENDS",
        "isinstance(host, ProcessHost)",
        "isinstance(host, (int, base.LocalHost))",
        "case 'ray'",
    }
