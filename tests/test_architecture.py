"""The package's shape (issue 11, docs/architecture.md): the layers import only downwards,
the system layer is numpy only, no import cycles between fedlora modules, no import of
another module's `_private` name, no module over MAX_LINES lines, no function over
MAX_FUNCTION_LINES lines (issue 38: a function does one thing; split it by concept).

An ast walk over src/fedlora: every `import`/`from ... import` counts, including those inside
functions (a lazy import hides a cycle from Python, not from the reader). The known size
violators are listed by name; the list must shrink: a new violator fails, and so does a listed
module that no longer violates (remove it from the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 400
# A function's or method's lines from its `def` line to its last (docstring and comments
# included, decorators not); no list of known violators: every function passes.
MAX_FUNCTION_LINES = 80

# Who may import whom (docs/architecture.md): a module imports only from its own layer or a
# lower one. The system layer imports only fedlora.errors and itself (no config, no I/O).
LAYER_RANK = {
    "errors": 0,
    "config": 0,
    "system": 1,
    "files": 2,
    "llm": 2,
    "federation": 3,
    "studies": 4,
    "commands": 5,
    "cli": 5,
}
SYSTEM_MAY_IMPORT = {"errors", "system"}
# Upward imports known today: (importer, imported); none since issue 11.
KNOWN_UPWARD: set[tuple[str, str]] = set()
NOT_IN_SYSTEM = ("torch", "transformers", "safetensors", "peft", "flwr", "pandas", "matplotlib")

# Today's modules over MAX_LINES (issue 11: split them, then delete their rows).
KNOWN_OVERSIZE: set[str] = set()
# Today's import cycles, each as the sorted tuple of its modules (issue 11: break them).
KNOWN_CYCLES: set[tuple[str, ...]] = set()
# Modules that read names of a face through it as a namespace (`from fedlora.system import
# planner as pl; pl.plan(...)`): (importer, face). Issue 23: import from the defining modules.
KNOWN_FACE_NAMESPACES: set[tuple[str, str]] = set()
# Imports of another module's private name: (importer, module, name); none since issue 11.
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()


def _modules(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted((src / "fedlora").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _ancestors(module: str) -> list[str]:
    """a.b.c -> [a, a.b]: the packages whose __init__ runs before a.b.c does."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(
    modules: dict[str, tuple[Path, bool]], *, ancestors: bool = True
) -> tuple[dict[str, set[str]], set[tuple]]:
    """The import graph over fedlora modules and the private names imported across modules.

    Importing a.b.c runs a/__init__ and a/b/__init__ first, so with `ancestors` an import of
    a.b.c is also an edge to every ancestor package of a.b.c that is not already one of the
    importer's own (those ran before the importer did); a package whose __init__ imports its
    folder's modules at run time (`pkgutil.iter_modules(__path__)`, the methods registry)
    has an edge to each of them.
    """
    edges: dict[str, set[str]] = {name: set() for name in modules}
    private: set[tuple[str, str, str]] = set()
    for name, (path, is_pkg) in modules.items():
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source not in modules:
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    target = sub if sub in modules else source
                    if target != name:
                        edges[name].add(target)
                    dunder = alias.name.startswith("__") and alias.name.endswith("__")
                    if target == source != name and alias.name.startswith("_") and not dunder:
                        private.add((name, source, alias.name))
        if ancestors and is_pkg and "pkgutil.iter_modules(__path__)" in path.read_text("utf-8"):
            # a registry package imports every module of its folder at run time
            edges[name] |= {m for m in modules if m.rpartition(".")[0] == name}
        if ancestors:
            own = set(_ancestors(name)) | {name}
            for target in list(edges[name]):
                edges[name] |= {a for a in _ancestors(target) if a in modules and a not in own}
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
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
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.add(tuple(sorted(comp)))
    return found


def test_the_walk_sees_a_cycle_and_a_private_import(tmp_path: Path) -> None:
    pkg = tmp_path / "fedlora"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from fedlora.sub.b import _hidden\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import c\n_hidden = 1\n")
    (pkg / "c.py").write_text("import fedlora.a\nfrom fedlora import __version__\n")
    edges, private = _imports(_modules(tmp_path))
    assert edges["fedlora.sub.b"] == {"fedlora.c"}
    assert _cycles(edges) == {("fedlora.a", "fedlora.c", "fedlora.sub.b")}
    assert private == {("fedlora.a", "fedlora.sub.b", "_hidden")}


def test_the_walk_sees_a_cycle_through_a_parent_package(tmp_path: Path) -> None:
    # the only cycle runs through fedlora/pkg/__init__: b imports fedlora.pkg.c, which runs
    # fedlora/pkg/__init__ first, which imports a, which imports b
    pkg = tmp_path / "fedlora"
    (pkg / "pkg").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pkg" / "__init__.py").write_text("from fedlora.pkg.a import f\n")
    (pkg / "pkg" / "a.py").write_text("def f():\n    from fedlora.b import g\n")
    (pkg / "pkg" / "c.py").write_text("h = 1\n")
    (pkg / "b.py").write_text("from fedlora.pkg.c import h\ng = h\n")
    modules = _modules(tmp_path)
    assert _cycles(_imports(modules, ancestors=False)[0]) == set()  # the rule before issue 23
    assert _cycles(_imports(modules)[0]) == {("fedlora.b", "fedlora.pkg", "fedlora.pkg.a")}
    # a sibling of the importer's own package adds no edge to that package
    (pkg / "pkg" / "a.py").write_text("from fedlora.pkg.c import h\n")
    assert _imports(_modules(tmp_path))[0]["fedlora.pkg.a"] == {"fedlora.pkg.c"}


def _faces(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the names it binds at its top level by importing them from fedlora (not
    defining them): importing such a name from it goes through a face."""
    out = {}
    for name, (path, _) in modules.items():
        bound, defined = set(), set()
        todo = list(ast.parse(path.read_text(encoding="utf-8")).body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:`, fallbacks
                todo += node.body + node.orelse + getattr(node, "finalbody", [])
                todo += [s for h in getattr(node, "handlers", []) for s in h.body]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedlora"):
                bound |= {a.asname or a.name for a in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in getattr(node, "targets", [getattr(node, "target", None)]):
                    defined |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        out[name] = bound - defined
    return out


def _face_imports(modules: dict[str, tuple[Path, bool]]) -> set[tuple[str, str, str]]:
    """(importer, face, name) for every `from face import name` inside the package where
    `face` only re-binds `name` (lazy imports included)."""
    faces = _faces(modules)
    found = set()
    for name, (path, _) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in modules:
                found |= {
                    (name, node.module, a.name)
                    for a in node.names
                    if a.name in faces[node.module] and f"{node.module}.{a.name}" not in modules
                }
    return found


def _face_namespaces(modules: dict[str, tuple[Path, bool]]) -> set[tuple[str, str]]:
    """(importer, face) where the importer binds a face module to a name (`from fedlora.system
    import planner as pl`) and reads through it a name the face only re-binds (`pl.plan`)."""
    faces = _faces(modules)
    found = set()
    for name, (path, _) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bound = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in modules:
                for a in node.names:
                    if faces.get(f"{node.module}.{a.name}"):
                        bound[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                bound |= {a.asname: a.name for a in node.names if a.asname and faces.get(a.name)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr in faces[bound[node.value.id]]
            ):
                found.add((name, bound[node.value.id]))
    return found


def test_the_walk_sees_an_import_through_a_face(tmp_path: Path) -> None:
    pkg = tmp_path / "fedlora"
    (pkg / "pkg").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pkg" / "__init__.py").write_text("from fedlora.pkg.a import f\n\ndef g():\n    f()\n")
    (pkg / "pkg" / "a.py").write_text("def f():\n    pass\n")
    (pkg / "b.py").write_text(
        "from fedlora.pkg import a, g\nfrom fedlora.pkg.a import f\n\n"
        "def h():\n    from fedlora.pkg import f\n"
    )
    assert _face_imports(_modules(tmp_path)) == {("fedlora.b", "fedlora.pkg", "f")}
    (pkg / "c.py").write_text("def h():\n    from fedlora import pkg as p\n\n    p.f(); p.g()\n")
    assert _face_namespaces(_modules(tmp_path)) == {("fedlora.c", "fedlora.pkg")}


def test_internal_imports_go_to_the_defining_module() -> None:
    # fedlora.config and fedlora.system.planner stay faces for users; inside the package every
    # import names the module that defines the name (docs/architecture.md)
    assert sorted(_face_imports(_modules())) == []
    used = _face_namespaces(_modules())
    assert sorted(used - KNOWN_FACE_NAMESPACES) == [], "a face read as a namespace"
    assert sorted(KNOWN_FACE_NAMESPACES - used) == [], "gone: delete them from KNOWN_..."


def _layer(module: str) -> str:
    """fedlora.<layer>[.…] -> <layer>; the package itself (fedlora) -> "errors" (rank 0)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "errors"


def test_every_module_has_a_layer() -> None:
    assert {_layer(m) for m in _modules()} <= set(LAYER_RANK)


def test_layers_import_only_downwards() -> None:
    upward = {
        (a, b)
        for a, targets in _imports(_modules())[0].items()
        for b in targets
        if LAYER_RANK[_layer(b)] > LAYER_RANK[_layer(a)]
        or (_layer(a) == "system" and _layer(b) not in SYSTEM_MAY_IMPORT)
    }
    assert sorted(upward - KNOWN_UPWARD) == [], "upward import(s)"
    assert sorted(KNOWN_UPWARD - upward) == [], "gone: delete them from KNOWN_UPWARD"


def test_no_module_launches_a_higher_layer() -> None:
    # `python -m fedlora.cli ...` from federation/ would be layer 3 starting layer 5: a module
    # name in a string counts as an import of it (the Flower worker has its own module)
    modules = _modules()
    launched = set()
    for name, (path, _) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in modules:
                if LAYER_RANK[_layer(node.value)] > LAYER_RANK[_layer(name)]:
                    launched.add((name, node.value))
    assert sorted(launched) == []


def test_system_layer_is_numpy_only() -> None:
    heavy = []
    for name, (path, _) in _modules().items():
        if _layer(name) != "system":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                heavy += [
                    f"{name}: {a.name}" for a in node.names if a.name.startswith(NOT_IN_SYSTEM)
                ]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                heavy += [f"{name}: {node.module}"] if node.module.startswith(NOT_IN_SYSTEM) else []
    assert heavy == []


def test_no_new_import_cycle() -> None:
    cycles = _cycles(_imports(_modules())[0])
    assert cycles - KNOWN_CYCLES == set(), "new import cycle(s)"
    assert KNOWN_CYCLES - cycles == set(), "broken cycle(s): delete them from KNOWN_CYCLES"


def test_no_new_private_import() -> None:
    private = _imports(_modules())[1]
    assert private - KNOWN_PRIVATE == set(), "import of another module's _private name"
    assert KNOWN_PRIVATE - private == set(), "gone: delete them from KNOWN_PRIVATE"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_size(name: str) -> None:
    path = _modules()[name][0]
    lines = len(path.read_text(encoding="utf-8").splitlines())
    if name in KNOWN_OVERSIZE:
        assert lines > MAX_LINES, f"{name} has {lines} lines now: delete it from KNOWN_OVERSIZE"
    else:
        assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES})"


def _long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Each function or method in `path` (nested ones too) longer than `limit` lines, counted
    from its `def` line to its last line, as "line N: name (n lines)"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"line {node.lineno}: {node.name} ({lines} lines)")
    return found


def test_the_function_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    path = tmp_path / "m.py"
    path.write_text(  # short: exactly the limit; C.long: one line over
        f"@staticmethod\ndef short():\n{body}\n\nclass C:\n"
        f"    async def long(self):\n        y = 0\n{body.replace('    ', '        ')}"
    )
    assert _long_functions(path) == [f"line 85: long ({MAX_FUNCTION_LINES + 1} lines)"]


@pytest.mark.parametrize("name", sorted(_modules()))
def test_function_size(name: str) -> None:
    path = _modules()[name][0]
    long = _long_functions(path)
    assert long == [], (
        f"{path.relative_to(SRC)}: over {MAX_FUNCTION_LINES} lines, split by concept: {long}"
    )


# Trees beside the product (issue 38 item 4): the studies (research/), the benchmarks (bench/)
# and the maintainers' tools (tools/) depend on fedlora; fedlora imports none of them.
OUTSIDE = ("research", "bench", "tools")


def _outside_imports(modules: dict[str, tuple[Path, bool]]) -> set[tuple[str, str]]:
    """(module, what) for every import of an OUTSIDE tree, and every string that names one of
    its modules (`importlib.import_module("research.x")`)."""
    found = set()
    for name, (path, _) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                names = [text] if "." in text and text.replace(".", "").isidentifier() else []
            else:
                continue
            found |= {(name, n) for n in names if n.split(".")[0] in OUTSIDE}
    return found


def test_the_walk_sees_an_import_of_the_research_tree(tmp_path: Path) -> None:
    pkg = tmp_path / "fedlora"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "import research.measure\nfrom tools import bit_identity\n"
        'def f():\n    from bench.engine import main\n    return "research.study_planner.x"\n'
    )
    (pkg / "b.py").write_text('"""research/README.md: the research beside the product."""\n')
    assert _outside_imports(_modules(tmp_path)) == {
        ("fedlora.a", "research.measure"),
        ("fedlora.a", "tools"),
        ("fedlora.a", "bench.engine"),
        ("fedlora.a", "research.study_planner.x"),
    }


def test_the_product_imports_nothing_from_research_bench_or_tools() -> None:
    assert sorted(_outside_imports(_modules())) == []


RESEARCH = SRC.parent / "research"


@pytest.mark.parametrize(
    "path", sorted(RESEARCH.rglob("*.py")), ids=lambda p: str(p.relative_to(RESEARCH))
)
def test_research_code_keeps_the_size_limits(path: Path) -> None:
    # the studies' code left the package, not its rules (issue 38 item 4)
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"research/{path.relative_to(RESEARCH)} has {lines} lines"
    assert _long_functions(path) == [], f"research/{path.relative_to(RESEARCH)}: split by concept"
