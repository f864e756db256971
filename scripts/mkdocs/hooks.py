"""mkdocs hooks (`hooks:` in mkdocs.yml): notebook kernels over IPC, notebook headings with
code, executed notebooks reused across builds.

mkdocs-jupyter executes every notebook through nbconvert, whose kernels listen on TCP
without encryption by default, and each kernel prints a warning saying so. nbconvert
reads `jupyter_nbconvert_config.py` from the Jupyter config path: this puts the one
beside this file (IPC transport, in a temporary directory) first on that path.

**Reuse.** With `JHOOKS_DOCS_CACHE=1` in the environment (`bash scripts/docs.sh` sets it)
and `CI` not set to a true value, a notebook's rendered page is kept in
`.cache/notebooks/` beside mkdocs.yml (git ignores `.cache/`) and reused by the next build
while nothing it depends on changed: mkdocs-jupyter's own cache, its key (the notebook's
bytes and the plugin's options) extended with a digest of the repository's Python sources a
notebook can import (`jhooks/`, `benchmarks/`, the examples' shared modules), of this
directory (how pages are rendered), of the Python version and of every installed
distribution's name and version. A build evicts the entries it did not use. Otherwise
(mkdocs.yml's `cache: false`, tests/test_docs.py's build, `CI=true`) every notebook
executes.
"""

import hashlib
import logging
import os
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

_CONFIG = str(Path(__file__).parent / "jupyter")
os.environ["JUPYTER_CONFIG_PATH"] = os.pathsep.join(
    p for p in (_CONFIG, os.environ.get("JUPYTER_CONFIG_PATH")) if p
)


# mkdocs-jupyter builds a notebook's table of contents and page title from its
# Markdown export, which drops inline code: "Module forward hooks: `register_forward_hook`"
# became "Module forward hooks: ". Built here from the notebook's Markdown cells instead,
# with the same Markdown extension, so headings keep their code (as text).
def _notebook_toc_tokens(fpath: str, toc_depth: int) -> tuple[list[dict], str | None]:
    import markdown
    import nbformat
    from markdown.extensions.toc import TocExtension

    notebook = nbformat.read(fpath, as_version=4)
    source = "\n\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    md = markdown.Markdown(extensions=[TocExtension(toc_depth=toc_depth)])
    md.convert(source)
    tokens = md.toc_tokens  # type: ignore[attr-defined]
    title = next((t["name"] for t in tokens if t["level"] == 1), None)
    return tokens, title


_LOG = logging.getLogger("mkdocs.hooks.notebook_cache")
_ROOT = Path(__file__).resolve().parents[2]
# Where a notebook's imports can come from in this repository (besides installed packages),
# and the files that decide how a page is rendered: a change to any of them re-executes.
_SOURCES = ("jhooks/**/*.py", "benchmarks/**/*.py", "examples/*.py", "scripts/mkdocs/**/*")
_TRUE = {"1", "true", "yes", "on"}


def _cache_wanted(environ: Mapping[str, str]) -> bool:
    """Whether this build reuses executed notebooks: asked for, and not on CI."""
    asked = environ.get("JHOOKS_DOCS_CACHE", "").strip().lower() in _TRUE
    return asked and environ.get("CI", "").strip().lower() not in _TRUE


def _environment_digest(root: Path) -> str:
    """A digest of what a notebook's outputs depend on besides its own bytes.

    The repository's Python sources under `_SOURCES` (path and bytes; a notebook's own
    jupytext source `examples/NN_name.py` is left out: the notebook holds the same
    cells), the Python version, and every installed distribution's name and version.
    """
    digest = hashlib.sha256(sys.version.encode())
    files = {p for pattern in _SOURCES for p in root.glob(pattern) if p.is_file()}
    for path in sorted(files):
        relative = path.relative_to(root).as_posix()
        if "__pycache__" in relative or (
            relative.startswith("examples/") and path.stem[:2].isdigit()
        ):
            continue
        digest.update(relative.encode() + b"\0" + path.read_bytes() + b"\0")
    versions = sorted(
        f"{d.metadata['Name']}=={d.version}".lower()
        for d in metadata.distributions()
        if d.metadata["Name"]
    )
    digest.update("\n".join(versions).encode())
    return digest.hexdigest()


def on_config(config):  # noqa: ANN001, ANN201 (mkdocs' hook signature)
    """Turns mkdocs-jupyter's cache on, keyed by the environment too, where wanted."""
    notebooks = config.plugins.get("mkdocs-jupyter")
    if notebooks is None or "cache" not in notebooks.config:  # none, or one with no cache
        return config
    if not _cache_wanted(os.environ):
        notebooks.config["cache"] = False
        _LOG.info("notebook cache off: every notebook executes")
        return config
    from mkdocs_jupyter import plugin

    environment = _environment_digest(_ROOT)
    own_key = getattr(plugin._compute_cache_key, "__wrapped__", plugin._compute_cache_key)

    def cache_key(nb_path, plugin_config, exec_nb):  # noqa: ANN001, ANN202
        key = own_key(nb_path, plugin_config, exec_nb)
        return hashlib.sha256(f"{key}:{environment}".encode()).hexdigest()

    cache_key.__wrapped__ = own_key  # type: ignore[attr-defined]
    plugin._compute_cache_key = cache_key
    cache_dir = Path(config.config_file_path).resolve().parent / ".cache" / "notebooks"
    notebooks.config["cache"] = True
    notebooks.config["cache_dir"] = str(cache_dir)
    _LOG.info(f"notebook cache on: unchanged notebooks come from {cache_dir}")
    return config


def _patch_mkdocs_jupyter() -> None:
    try:
        from mkdocs_jupyter import plugin
    except ImportError:  # the docs extra is not installed: nothing to patch
        return
    plugin._get_nb_toc_tokens = _notebook_toc_tokens


_patch_mkdocs_jupyter()
