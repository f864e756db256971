"""The documentation: every public name is documented, and the site builds strictly.

The site is built once per test run, here (`bash scripts/test.sh` builds no other): mkdocs
executes every notebook as it builds it, so the pages show their outputs and plots. This is
the one place the notebooks run (`tests/test_notebooks.py` checks them without running them):
a failing cell fails the build, and every code cell of every notebook must show its output
prompt.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import jhooks

ROOT = Path(__file__).parents[1]
API_PAGE = ROOT / "docs" / "api.md"


def public_names() -> list[str]:
    """Every public name of the `jhooks` package, as `jhooks/__init__.py` exports them."""
    names = getattr(jhooks, "__all__", None)
    if names is None:
        names = [
            name
            for name, value in vars(jhooks).items()
            if not name.startswith("_")
            and not (
                isinstance(value, types.ModuleType) and value.__name__.split(".")[0] != "jhooks"
            )
        ]
    return sorted(names)


def documented_names() -> list[str]:
    """The names given a `::: jhooks.name` entry in the API reference."""
    return re.findall(r"^::: jhooks\.([\w.]+)\s*$", API_PAGE.read_text(), flags=re.MULTILINE)


def test_public_names_found():
    # The core's names, so that a broken name discovery cannot pass vacuously.
    core = {"register_hook", "retain_grad", "grad", "value_and_grad", "register_multi_grad_hook"}
    assert core | {"Node", "host", "RemovableHandle"} <= set(public_names())


@pytest.mark.parametrize("name", public_names())
def test_public_name_is_in_api_reference(name):
    assert name in documented_names(), (
        f"jhooks.{name} is exported by jhooks/__init__.py but missing from docs/api.md: "
        f"add a line `::: jhooks.{name}` under the right heading."
    )


def test_api_reference_lists_only_public_names():
    documented = documented_names()
    assert len(documented) == len(set(documented)), "docs/api.md lists a name twice"
    stale = set(documented) - set(public_names())
    assert not stale, f"docs/api.md documents names jhooks does not export: {sorted(stale)}"


def _undocumented_members(cls: type) -> list[str]:
    missing = []
    for member, attr in vars(cls).items():
        if member.startswith("_"):
            continue
        if not (callable(attr) or isinstance(attr, (property, staticmethod, classmethod))):
            continue
        if not inspect.getdoc(getattr(cls, member)):
            missing.append(member)
    return missing


@pytest.mark.parametrize("name", public_names())
def test_public_name_has_docstring(name):
    obj = getattr(jhooks, name)
    if not isinstance(obj, (type, types.FunctionType, types.ModuleType)) and not callable(obj):
        pytest.fail(f"jhooks.{name} is {type(obj).__name__}: only document functions/classes")
    doc = inspect.getdoc(obj)
    assert doc and len(doc.split()) >= 5, f"jhooks.{name} has no docstring"
    if isinstance(obj, type):
        missing = _undocumented_members(obj)
        assert not missing, f"public methods of jhooks.{name} without a docstring: {missing}"


def test_mkdocs_builds_strictly(tmp_path):
    site = tmp_path / "site"
    # Material 9.7+ prints an end-of-life banner at every build; the `docs` extra pins 9.6,
    # and this variable silences it where a newer one is installed. Every notebook
    # executes here: no page comes from `bash scripts/docs.sh`'s cache of executed notebooks.
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", JHOOKS_DOCS_CACHE="0")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        # Twelve notebooks executed: 471 s for the first eleven, about 90 s for the twelfth
        # (examples/12_recipes) on the 2-core machine shared with other jobs.
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert "notebook cache off" in output and "Cache hit" not in output
    # No warning: none from mkdocs or a plugin, none from a notebook's kernel (TCP without
    # encryption: scripts/mkdocs/hooks.py), no missing-formatter notice, no banner.
    for notice in (
        "WARNING",
        "Kernel is running over TCP",
        "Formatting signatures requires",
        "end of life",
    ):
        lines = [line for line in output.splitlines() if notice in line]
        assert not lines, "the docs build printed:\n" + "\n".join(lines)
    api = (site / "api" / "index.html").read_text()
    for name in public_names():
        assert f'id="jhooks.{name}"' in api, f"jhooks.{name} is not rendered in the API page"
    # Every notebook is in the nav, rendered, and executed: its page shows outputs.
    nav = (ROOT / "mkdocs.yml").read_text()
    plots = 0
    for notebook in sorted((ROOT / "examples").glob("*.ipynb")):
        assert f"examples/{notebook.name}" in nav, f"add examples/{notebook.name} to mkdocs.yml nav"
        page = site / "examples" / notebook.stem / "index.html"
        assert page.exists(), f"examples/{notebook.name} is not rendered: add it to mkdocs.yml nav"
        html = page.read_text()
        assert "jhooks" in html
        assert 'data-mime-type="text/plain"' in html, f"{notebook.name} is rendered without outputs"
        # Every code cell ran, in order (mkdocs-jupyter stops at a failing cell, and fails).
        cells = json.loads(notebook.read_text())["cells"]
        code_cells = sum(cell["cell_type"] == "code" for cell in cells)
        prompts = [int(n) for n in re.findall(r">In\s\[(\d+)\]:<", html)]
        assert prompts == list(range(1, code_cells + 1)), (
            f"{notebook.name}: {code_cells} code cells, executed {prompts}"
        )
        plots += html.count('src="data:image/png')
    assert plots >= 1, "no notebook page shows a plot: is mkdocs-jupyter's `execute` on?"
    # Every link within a page ("On this page", a heading's permalink) reaches an id of that
    # page: two notebook headings with one text would share an id, and the later's link not.
    for page in sorted(site.rglob("*.html")):
        html = page.read_text()
        ids = set(re.findall(r'\bid="([^"]+)"', html))
        missing = sorted(set(re.findall(r'href="#([^"]+)"', html)) - ids)
        assert not missing, f"{page.relative_to(site)} links to ids it lacks: {missing}"
    # Notebook titles keep their inline code (mkdocs-jupyter's own title drops it).
    page = (site / "examples" / "02_module_forward_hooks" / "index.html").read_text()
    assert "<title>Module forward hooks: register_forward_pre_hook and" in page
    # A `|` inside code in a table shows without the backslash that escapes it.
    assert "tuple \\| None" not in (site / "pytorch" / "index.html").read_text()
    assert "tuple &#124; None" in (ROOT / "docs" / "pytorch.md").read_text()
    # The quickstart shows its scripts, included from docs/quickstart/.
    quickstart = (site / "quickstart" / "index.html").read_text()
    assert "filter_value_and_grad" in quickstart and "PrivacyEngine" in quickstart
    assert "nnx.Optimizer" in quickstart
    # The changelog page is CHANGELOG.md, at the version the package has.
    changelog = (site / "changelog" / "index.html").read_text()
    assert f"[{jhooks.__version__}]" in changelog and "Keep a Changelog" in changelog
    # The benchmarks page includes the results file rather than a copy of it.
    results = (ROOT / "benchmarks" / "results" / "cpu.md").read_text()
    first_table_title = next(line for line in results.splitlines() if line.startswith("### "))
    benchmarks_page = (site / "benchmarks" / "index.html").read_text()
    assert first_table_title.removeprefix("### ").split(" (")[0] in benchmarks_page


@pytest.mark.parametrize(
    "name",
    [
        "ForwardPreHook",
        "ForwardPreHookWithKwargs",
        "ForwardHook",
        "ForwardHookWithKwargs",
        "BackwardPreHook",
        "BackwardHook",
        "ParameterHook",
        "HookName",
        "Module",
        "Node",
        "RemovableHandle",
    ],
)
def test_hook_types_and_their_methods_have_examples(name):
    cls = getattr(jhooks, name)
    docs = {name: inspect.getdoc(cls)}
    for member, attr in vars(cls).items():
        if not member.startswith("_") and (callable(attr) or isinstance(attr, property)):
            docs[f"{name}.{member}"] = inspect.getdoc(getattr(cls, member))
    missing = [where for where, doc in docs.items() if "Example" not in (doc or "")]
    assert not missing, f"no example in the docstrings of {missing}"


# The docs build from the `docs` extra alone, and link every notebook.

NOTEBOOKS = sorted((ROOT / "examples").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_notebook_is_linked_from_the_home_page_and_the_nav(notebook):
    link = f"examples/{notebook.name}"
    assert f"]({link})" in (ROOT / "docs" / "index.md").read_text(), (
        f"docs/index.md does not link {link}: add it to the list of notebooks there"
    )
    assert f": {link}\n" in (ROOT / "mkdocs.yml").read_text(), (
        f"mkdocs.yml's nav does not list {link}: add it under Examples"
    )


def test_home_page_counts_the_notebooks():
    count = "one two three four five six seven eight nine ten eleven twelve thirteen".split()
    home = (ROOT / "docs" / "index.md").read_text()
    assert f"The {count[len(NOTEBOOKS) - 1]} example notebooks" in home


def _imported_top_level_names(path: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _notebook_imports() -> set[str]:
    """The top-level modules the notebooks import (through their jupytext sources and the
    example files they import), less the standard library and the examples' own files."""
    local = {p.stem for p in (ROOT / "examples").glob("*.py")}
    sources = list((ROOT / "examples").glob("[0-9][0-9]_*.py"))
    names: set[str] = set()
    seen: set[str] = set()
    while sources:
        source = sources.pop()
        seen.add(source.stem)
        found = _imported_top_level_names(source)
        names |= found
        sources += [ROOT / "examples" / f"{n}.py" for n in found & local if n not in seen]
    return names - local - set(sys.stdlib_module_names)


def _installed_by(requirements: list[str], extras_of: dict[str, list[str]]) -> set[str]:
    """The distributions (normalized names) that installing `requirements` installs: each,
    its own extras of jhooks, and what each requires, as installed here."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name == "jhooks":
            todo += [Requirement(r) for extra in req.extras for r in extras_of[extra]]
            continue
        if name in found:
            continue
        found.add(name)
        for line in metadata.requires(req.name) or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return found


def test_docs_extra_installs_every_package_the_notebooks_import():
    import tomllib
    from importlib import metadata

    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    installed = _installed_by(project["dependencies"] + extras["docs"], extras)
    imports = _notebook_imports()
    # The notebooks' imports, so that a broken import parser cannot pass vacuously.
    assert {"jax", "equinox", "torch", "opacus", "flax", "optax", "matplotlib"} <= imports
    distributions = metadata.packages_distributions()
    missing = {
        name: distributions[name]
        for name in sorted(imports - {"jhooks"})
        if not {canonicalize_name(d) for d in distributions[name]} & installed
    }
    assert not missing, (
        f"the notebooks import {sorted(missing)}, which the `docs` extra does not install "
        f"(distributions {missing}): add them to [project.optional-dependencies] docs"
    )


# Executed notebooks reused across builds (scripts/mkdocs/hooks.py): asked for with
# JHOOKS_DOCS_CACHE=1 (`bash scripts/docs.sh`), never on CI.

HOOKS = ROOT / "scripts" / "mkdocs" / "hooks.py"


def _build_tiny_site(site_root: Path, **environ: str) -> str:
    """Builds a one-notebook site with the repository's hooks; returns what its cell printed.

    The cell prints a fresh random number each time it executes: the same number in two
    builds means the second reused the first's execution.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "JHOOKS_DOCS_CACHE")}
    env.update(environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site_root / "site")],
        cwd=site_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    html = (site_root / "site" / "nb" / "index.html").read_text()
    (printed,) = re.findall(r"executed-(\d+)", html)
    return printed


def test_docs_build_reuses_executed_notebooks_unless_on_ci(tmp_path):
    import nbformat

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[the notebook](nb.ipynb)\n")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("# A notebook"),
        nbformat.v4.new_code_cell("import random\nprint(f'executed-{random.getrandbits(60)}')"),
    ]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(notebook, tmp_path / "docs" / "nb.ipynb")
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: tiny\nstrict: true\nnav:\n  - index.md\n  - nb.ipynb\n"
        f"hooks:\n  - {HOOKS}\n"
        "plugins:\n  - mkdocs-jupyter:\n      execute: true\n      allow_errors: false\n"
        "      kernel_name: python3\n      cache: false\n"
    )
    first = _build_tiny_site(tmp_path, JHOOKS_DOCS_CACHE="1")
    assert [p.suffix for p in (tmp_path / ".cache" / "notebooks").iterdir()] == [".json"]
    assert _build_tiny_site(tmp_path, JHOOKS_DOCS_CACHE="1") == first
    # CI executes it again, whatever JHOOKS_DOCS_CACHE says (a build not asking for the
    # cache: `_cache_wanted` below, and the strict build above says "notebook cache off").
    assert _build_tiny_site(tmp_path, JHOOKS_DOCS_CACHE="1", CI="true") != first


def test_notebook_cache_key_follows_the_sources_and_packages(tmp_path, monkeypatch):
    hooks = _load_docs_hooks()
    (tmp_path / "jhooks").mkdir()
    (tmp_path / "examples").mkdir()
    (tmp_path / "jhooks" / "_runs.py").write_text("x = 1\n")
    (tmp_path / "examples" / "small_cnn.py").write_text("y = 1\n")
    (tmp_path / "examples" / "01_value_hooks.py").write_text("# a notebook's source\n")
    before = hooks._environment_digest(tmp_path)
    assert hooks._environment_digest(tmp_path) == before
    # A notebook's own jupytext source is not in the digest (the notebook's bytes are in
    # mkdocs-jupyter's key); the sources a notebook can import, and their paths, are.
    (tmp_path / "examples" / "01_value_hooks.py").write_text("# edited\n")
    assert hooks._environment_digest(tmp_path) == before
    changes = [
        lambda: (tmp_path / "jhooks" / "_runs.py").write_text("x = 2\n"),
        lambda: (tmp_path / "examples" / "small_cnn.py").write_text("y = 2\n"),
        lambda: (tmp_path / "jhooks" / "_runs.py").rename(tmp_path / "jhooks" / "_other.py"),
        lambda: monkeypatch.setattr(hooks.metadata, "distributions", lambda: []),
    ]
    seen = {before}
    for change in changes:
        change()
        digest = hooks._environment_digest(tmp_path)
        assert digest not in seen
        seen.add(digest)
    assert hooks._cache_wanted({"JHOOKS_DOCS_CACHE": "1"})
    assert not hooks._cache_wanted({"JHOOKS_DOCS_CACHE": "1", "CI": "true"})
    assert not hooks._cache_wanted({"JHOOKS_DOCS_CACHE": "0"})
    assert not hooks._cache_wanted({})


def _load_docs_hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", HOOKS)
    assert spec and spec.loader
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def _toc_ids(tokens: list[dict]) -> list[str]:
    return [i for token in tokens for i in [token["id"], *_toc_ids(token["children"])]]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_page_links_reach_its_headings(notebook):
    # The quick form of the full build's in-page link check, for notebook pages: the page's
    # table of contents (built by scripts/mkdocs/hooks.py from the Markdown cells) and every
    # `#anchor` link in the notebook point to ids the rendered notebook has (mkdocs-jupyter
    # renders it with nbconvert, which makes the headings' ids its own way). Not executed:
    # the ids come from the Markdown cells alone.
    from mkdocs_jupyter import convert

    html = convert.nb2html(str(notebook), execute=False)
    ids = set(re.findall(r'\bid="([^"]+)"', html))
    tokens, title = _load_docs_hooks()._notebook_toc_tokens(str(notebook), 6)
    assert title and len(_toc_ids(tokens)) >= 2
    missing = sorted(set(_toc_ids(tokens)) - ids)
    assert not missing, f"{notebook.name}: its table of contents links to ids it lacks: {missing}"
    missing = sorted(set(re.findall(r'href="#([^"]+)"', html)) - ids)
    assert not missing, f"{notebook.name} links to ids it lacks: {missing}"
