"""mkdocs hooks (`hooks:` in mkdocs.yml): notebook kernels over IPC, notebook headings with code.

mkdocs-jupyter executes every notebook through nbconvert, whose kernels listen on TCP
without encryption by default, and each kernel prints a warning saying so. nbconvert
reads `jupyter_nbconvert_config.py` from the Jupyter config path: this puts the one
beside this file (IPC transport, in a temporary directory) first on that path.
"""

import os
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


def _patch_mkdocs_jupyter() -> None:
    try:
        from mkdocs_jupyter import plugin
    except ImportError:  # the docs extra is not installed: nothing to patch
        return
    plugin._get_nb_toc_tokens = _notebook_toc_tokens


_patch_mkdocs_jupyter()
