"""The documentation: every public name is documented, and the site builds strictly; the
pages name the extras of the libraries they use, and the tunix example runs as written.

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
import tomllib
import types
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


# What the pages tell a new user (issue 44, the first hour): a page that uses tunix, Haiku
# or transformers names the extra that installs it (`pip install "jhooks[tunix]"`), the
# extra read from pyproject.toml; the tunix Llama 3 example of docs/other_models.md is
# complete: executed here as the page shows it (its `config`, positions and `mask` built
# on the page), its results checked.

# The pages a user reads: the README, the docs, the notebooks' sources (the `.ipynb`
# twins are checked equal to them by tests/test_notebooks.py).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES += sorted((ROOT / "examples").glob("[0-9][0-9]_*.py"))
# The libraries of published models the docs use, by the name they are imported (and
# written) as; which distribution each is and which extra installs it are read below.
LIBRARIES = ["tunix", "haiku", "transformers"]
# `pip install "jhooks[a,b]"` or, in the README's clone, `pip install -e ".[a]"`.
INSTALL = re.compile(r"""pip install (?:-e )?["']?(?:jhooks|\.)\[([\w,-]+)\]""")


def _extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"]


def extra_of(library: str) -> str:
    """The one extra that lists `library`'s distribution itself (the `test` extra takes
    it through that extra, `jhooks[...]`)."""
    distributions = {canonicalize_name(d) for d in metadata.packages_distributions()[library]}
    listing = [
        extra
        for extra, requirements in _extras().items()
        if any(canonicalize_name(Requirement(r).name) in distributions for r in requirements)
    ]
    assert len(listing) == 1, (library, distributions, listing)
    return listing[0]


def _installs(text: str) -> set[str]:
    """The extras a page's `pip install` lines name."""
    return {extra for match in INSTALL.findall(text) for extra in match.split(",")}


def test_the_extras_are_read_from_pyproject():
    # The mapping the next test reads, written out, so that a broken reader cannot pass
    # vacuously: each library's own extra, which the test extra includes.
    assert {lib: extra_of(lib) for lib in LIBRARIES} == {
        "tunix": "tunix",
        "haiku": "haiku",
        "transformers": "transformers",
    }
    assert "jhooks[tunix,haiku,transformers]" in _extras()["test"]
    assert _installs('pip install "jhooks[tunix]" and pip install -e ".[flax,haiku]"') == {
        "tunix",
        "flax",
        "haiku",
    }


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_page_using_a_library_names_its_extra(library):
    extra = extra_of(library)
    mentioning = [p for p in PAGES if re.search(rf"\b{library}\b", p.read_text(), re.IGNORECASE)]
    assert ROOT / "docs" / "other_models.md" in mentioning  # not vacuous
    missing = [
        str(p.relative_to(ROOT)) for p in mentioning if extra not in _installs(p.read_text())
    ]
    assert not missing, (
        f'these pages mention {library} but not `pip install "jhooks[{extra}]"`, the '
        f"extra of pyproject.toml that installs it: {missing}"
    )


def _tunix_example() -> str:
    """The one Python block of docs/other_models.md's section "TransformerLens names"."""
    page = (ROOT / "docs" / "other_models.md").read_text()
    section = page.split("\n## TransformerLens names\n")[1].split("\n### ")[0]
    (code,) = re.findall(r"^```python\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    return code


# tunix 0.1.7's own code uses what JAX and Flax deprecate (see test_published_names.py).
@pytest.mark.filterwarnings(r"ignore::DeprecationWarning:tunix\.")
@pytest.mark.filterwarnings("ignore:'sharding' is deprecated:DeprecationWarning")
def test_the_tunix_llama3_example_runs_as_written():
    import flax
    from tunix_models import tunix_module

    code = _tunix_example()
    assert "config = llama3.ModelConfig(" in code and "mask = " in code
    # `from tunix.models.llama3 import model` finds the model module without tunix's
    # package __init__ (its trainers), as the other tunix tests do; importing tunix sets
    # Flax's eager sharding off, as here while the example runs.
    tunix_module("llama3")
    flag = flax.config.flax_always_shard_variable
    flax.config.update("flax_always_shard_variable", False)
    namespace: dict = {}
    # tunix divides int32 positions by float32 timescales: JAX's standard promotion, a
    # user's default (the suite's conftest makes it strict).
    with jax.numpy_dtype_promotion("standard"):
        try:
            exec(compile(code, "docs/other_models.md (TransformerLens names)", "exec"), namespace)
        finally:
            flax.config.update("flax_always_shard_variable", flag)
        _check_the_tunix_example(namespace)


def _check_the_tunix_example(namespace: dict) -> None:
    model, args, logits = namespace["model"], namespace["args"], namespace["logits"]
    tokens, positions, cache_arg, mask = args
    assert tokens.shape == (1, 6) and positions.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert cache_arg is None and mask.dtype == jnp.bool_ and mask.shape == (1, 6, 6)

    # The run's logits are the model's (a compiled program: to float32 rounding); the
    # pattern is causal, each row a distribution.
    np.testing.assert_allclose(logits, model(*args)[0], rtol=1e-6, atol=1e-7)
    assert logits.shape == (1, 6, 32)
    pattern = np.asarray(namespace["cache"]["blocks.1.attn.hook_pattern"])
    assert pattern.shape == (1, 4, 6, 6)
    above = np.triu_indices(6, 1)  # key after query
    assert np.all(pattern[..., above[0], above[1]] == 0)
    np.testing.assert_allclose(pattern.sum(-1), 1.0, rtol=1e-6)

    # The ablation equals zeroing head 2 at the address the name stands for.
    def zero_head_2(z, name):
        return z.at[:, :, 2].set(0.0)

    address = namespace["tl"].address("blocks.1.attn.hook_z")
    assert address == "layers.1.attn.o_proj:in"
    by_address, _ = jhooks.run_with_hooks(model, *args, fwd_hooks=[(address, zero_head_2)])
    np.testing.assert_array_equal(namespace["ablated"], by_address)
    assert float(jnp.max(jnp.abs(namespace["ablated"] - logits))) > 1e-4

    # Attribution: the corrupted token is at position 2, so with the causal mask the
    # positions before it score exactly 0; the last layer's heads move the metric (the
    # last position's logits) only at the last position.
    scores = namespace["scores"]
    assert list(scores) == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
    for s in scores.values():
        assert s.shape == (1, 6, 4)
        np.testing.assert_array_equal(s[:, :2], 0.0)
    assert np.all(np.asarray(scores["blocks.1.attn.hook_z"][:, :5]) == 0.0)
    assert np.all(np.asarray(scores["blocks.1.attn.hook_z"][:, 5]) != 0.0)
    assert np.all(np.isfinite(np.asarray(scores["blocks.0.attn.hook_z"])))
