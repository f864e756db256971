"""The table of docs/pytorch.md ("PyTorch's own tests, case by case") counts the tests here."""

import ast
import pathlib
import re

HERE = pathlib.Path(__file__).parent
DOCS = HERE.parent.parent / "docs" / "pytorch.md"

# Each suite's row in the table, and the prefix of the tests that translate its cases.
# And how the table of cases not translated names the suite.
SUITES = {
    "`test/nn/test_module_hooks.py`": ("test_torch_module_hooks.py", "test_module_hooks_"),
    "`test/test_autograd.py`": ("test_torch_autograd_hooks.py", "test_autograd_"),
    "`tests/integration/test_hooks.py`": ("test_transformer_lens_hooks.py", "test_hooks_"),
    "`tests/unit/test_hook_points.py`": ("test_transformer_lens_hooks.py", "test_hook_points_"),
}
LABELS = {
    "`test/nn/test_module_hooks.py`": "test_module_hooks",
    "`test/test_autograd.py`": "test_autograd",
    "`tests/integration/test_hooks.py`": "test_hooks.py",
    "`tests/unit/test_hook_points.py`": "test_hook_points.py",
}


def _tests(path: pathlib.Path, prefix: str) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith(prefix)
    ]


def _rows() -> dict[str, list[int]]:
    section = DOCS.read_text().split("## PyTorch's own tests, case by case")[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        for key in SUITES:
            if line.startswith("|") and key in cells[0] and len(cells) == 5:
                rows[key] = [int(c) for c in cells[1:]]
    return rows


def test_the_table_counts_the_translated_tests():
    section = DOCS.read_text().split("## PyTorch's own tests, case by case")[1]
    rows = _rows()
    assert set(rows) == set(SUITES)
    total = [0, 0, 0, 0]
    for key, (seen, translated, passing, not_translated) in rows.items():
        file, prefix = SUITES[key]
        names = _tests(HERE / file, prefix)
        assert len(names) == translated == passing, (key, names)
        assert seen == translated + not_translated
        total = [t + v for t, v in zip(total, rows[key])]
    bold = re.search(r"\| \*\*total\*\* \| (.*) \|", section)
    assert bold is not None
    assert [int(c.strip(" *")) for c in bold.group(1).split("|")] == total


def test_the_cases_not_translated_are_each_named_with_a_reason():
    text = DOCS.read_text().split("## PyTorch's own tests, case by case")[1]
    table = text.split("Not translated, and why:")[1]
    counts = {}
    for line in table.splitlines():
        if not line.startswith("| ") or line.startswith("| case"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 2 or not cells[1]:
            continue
        suite = cells[0].split("`")[1]
        names = re.findall(r"`((?:[A-Za-z]+\.)?(?:test)?_[A-Za-z0-9_]+)`", cells[0])
        names = [n for n in names if n != suite]
        counts[suite] = counts.get(suite, 0) + len(names)
    assert counts == {LABELS[key]: row[3] for key, row in _rows().items()}
