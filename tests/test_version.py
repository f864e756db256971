"""One version: pyproject.toml's, `jhooks.__version__`, CHANGELOG.md's top entry and the docs'."""

import re
import tomllib
from pathlib import Path

import jhooks

ROOT = Path(__file__).parents[1]


def test_pyproject_version_dunder_version_and_changelog_agree():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert jhooks.__version__ == version
    changelog = (ROOT / "CHANGELOG.md").read_text()
    entries = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", changelog, flags=re.MULTILINE)
    assert entries[0] == version, f"CHANGELOG.md's top entry is {entries[0]}, not {version}"
    # Newest first, each version once.
    keys = [tuple(map(int, e.split("."))) for e in entries]
    assert keys == sorted(set(keys), reverse=True), entries
    # The docs speak of the same version, and show the changelog.
    home = (ROOT / "docs" / "index.md").read_text()
    assert f"jhooks {version}" in home and "(changelog.md)" in home
    assert '--8<-- "CHANGELOG.md"' in (ROOT / "docs" / "changelog.md").read_text()
    assert "changelog.md" in (ROOT / "mkdocs.yml").read_text()
