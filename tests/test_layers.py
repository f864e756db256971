"""The architecture, checked: layers as subpackages, imports only downward, fences.

An AST walk over `jhooks/` (no import of jhooks): every import between jhooks' modules is
resolved to the module it names, and the rules of `jhooks/README.md` are checked:

- the subpackages are layers, `LAYERS` from the bottom: a module imports only from its
  own layer or one below;
- across subpackages, a module imports only what the subpackage's `__init__` re-exports,
  and never a private name;
- no import cycle between modules (imports under `if TYPE_CHECKING:` are for types only);
- JAX and Equinox internals are imported only in the fences of `_core`;
- a subpackage's `__init__.py` only re-exports, and each subpackage has a README;
- no module is over 400 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "jhooks"
LAYERS = (
    "_core",
    "_staging",
    "_autograd",
    "_runs",
    "_modules",
    "_per_example",
    "_nnx",
    "_linen_haiku",
    "_attribution",
    "_names",
)
# The JAX fence is a package (`_core/_jax_compat/`), the Equinox fence one module.
FENCES = {
    "_core/_jax_compat/__init__.py",
    "_core/_jax_compat/_anchors.py",
    "_core/_jax_compat/_batch_axes.py",
    "_core/_jax_compat/_equations.py",
    "_core/_jax_compat/_host_call.py",
    "_core/_jax_compat/_leaks.py",
    "_core/_jax_compat/_tracing.py",
    "_core/_equinox_compat.py",
}
INTERNAL = (
    "jax._src.",
    "jax.core.",
    "jax.extend.",
    "jax.interpreters.",
    "jaxlib.",
    "equinox._",
    "equinox.internal.",
)
# The two flat modules that 0.2's pickles name (aliases of the code in `_modules`).
PICKLE_ALIASES = {"_hookable.py", "_module_registry.py"}


def _modules() -> dict[str, Path]:
    """Dotted name inside jhooks ("_core._primitive", "_core" for its __init__) -> file."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package_of(name: str, path: Path) -> str:
    """The package a module's relative imports start from."""
    if path.name == "__init__.py":
        return name
    return name.rpartition(".")[0]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import run when the module runs, at any depth (functions included), but
    not those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child)

    visit(tree)
    return found


def _resolve(name: str, path: Path, node: ast.ImportFrom) -> list[tuple[str, str]]:
    """(module imported from, name imported) for a relative or `jhooks.` import."""
    if node.level:
        base = _package_of(name, path).split(".") if _package_of(name, path) else []
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        target = ".".join([*base, *(node.module.split(".") if node.module else [])])
    elif node.module and (node.module == "jhooks" or node.module.startswith("jhooks.")):
        target = node.module.removeprefix("jhooks").lstrip(".")
    else:
        return []
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}" if target else alias.name
        # `from . import _mod` imports a module; `from ._mod import x` a name.
        out.append((sub, "") if sub in MODULES else (target, alias.name))
    return out


def _edges() -> list[tuple[str, str, str, int]]:
    """(importer, imported module, imported name or "", line) for every jhooks import."""
    edges = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree):
            if isinstance(node, ast.ImportFrom):
                for target, imported in _resolve(name, path, node):
                    edges.append((name, target, imported, node.lineno))
    return edges


EDGES = _edges()


def _layer(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in LAYERS else None


def test_every_module_is_in_a_layer():
    stray = [
        str(path.relative_to(ROOT))
        for name, path in MODULES.items()
        if name and _layer(name) is None and path.name not in PICKLE_ALIASES
    ]
    assert stray == [], f"modules outside the layers {LAYERS}: {stray}"
    for layer in {_layer(n) for n in MODULES if _layer(n)}:
        assert (ROOT / str(layer) / "README.md").exists(), f"{layer} has no README.md"


def test_imports_only_go_down():
    wrong = []
    for importer, target, _, line in EDGES:
        a, b = _layer(importer), _layer(target)
        if a and b and LAYERS.index(b) > LAYERS.index(a):
            wrong.append(f"{importer}:{line} imports {target} (layer {b} is above {a})")
    assert wrong == []


def test_across_layers_only_what_the_subpackage_exports():
    wrong = []
    for importer, target, imported, line in EDGES:
        a, b = _layer(importer), _layer(target)
        if a is None or b is None or a == b:
            continue
        if target != b:
            wrong.append(f"{importer}:{line} imports from {target}, not from {b}'s __init__")
        elif imported.startswith("_") or imported == "":
            wrong.append(f"{importer}:{line} imports the private name {imported or target}")
    assert wrong == []


def test_no_import_cycle():
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for importer, target, _, _ in EDGES:
        if target in MODULES and target != importer:
            graph[importer].add(target)
    # A package's __init__ is imported before its modules: importing `_core._emit`
    # runs `_core` first, so the edge to a submodule is also an edge to its package.
    for importer, target, _, _ in list(EDGES):
        package = target.rpartition(".")[0]
        inside = importer == package or importer.startswith(package + ".")
        if package and package in MODULES and not inside:
            graph[importer].add(package)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_internals_only_in_the_fences():
    wrong = []
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        if rel in FENCES:
            continue
        source = path.read_text()
        for node in _imports(ast.parse(source)):
            modules = (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            )
            for module in modules:
                if module and (module + ".").startswith(INTERNAL):
                    wrong.append(f"{rel}:{node.lineno} imports {module}")
        for internal in ("jax._src", "jax.extend", "jax.core.", "jax.interpreters", "eqx.internal"):
            for i, text in enumerate(source.splitlines(), 1):
                code = text.split("#")[0]
                if internal in code and "`" not in code and '"' not in code:
                    wrong.append(f"{rel}:{i} uses {internal}")
    assert wrong == []


@pytest.mark.parametrize("layer", sorted({_layer(n) for n in MODULES if _layer(n)}))
def test_a_subpackage_init_only_reexports(layer):
    tree = ast.parse((ROOT / str(layer) / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{layer}: {ast.unparse(node)}"


def test_no_module_over_400_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert long == {}


def test_the_checker_sees_a_bad_import():
    # The walk itself: an upward, a deep and a private import are found in a sample.
    source = (
        "from .._runs import hook_point\n"
        "from .._core._primitive import bind\n"
        "from .._core import _private\n"
        "if TYPE_CHECKING:\n    from .._modules import Registry\n"
    )
    fake = ROOT / "_autograd" / "_sample.py"
    edges = []
    for node in _imports(ast.parse(source)):
        assert isinstance(node, ast.ImportFrom)
        edges += _resolve("_autograd._sample", fake, node)
    assert edges == [("_runs", "hook_point"), ("_core._primitive", "bind"), ("_core", "_private")]
