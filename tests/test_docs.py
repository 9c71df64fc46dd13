"""The docs' Python examples run as written (each block on its own, in a fresh namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def blocks(name: str) -> list[tuple[str, str]]:
    text = (ROOT / name).read_text()
    return [(f"{name}#{i}", code) for i, code in enumerate(BLOCK.findall(text))]


RUNNABLE = (
    blocks("docs/migration.md")
    + blocks("docs/api.md")
    + blocks("docs/distributed.md")
    + blocks("docs/gpu.md")
    + blocks("docs/tuning.md")
    + blocks("docs/pipeline.md")
)


@pytest.mark.usefixtures("no_leak")
@pytest.mark.parametrize(("where", "code"), RUNNABLE, ids=[where for where, _ in RUNNABLE])
def test_docs_example_runs(where, code):
    # dont_inherit: a block runs as its own file, without this module's __future__ imports
    exec(compile(code, where, "exec", dont_inherit=True), {"__name__": "__docs__"})


@pytest.mark.parametrize(
    ("where", "code"), blocks("README.md"), ids=[w for w, _ in blocks("README.md")]
)
def test_readme_example_compiles(where, code):
    """README snippets use the reader's own ``dataset``/``paths``: they must at least compile."""
    compile(code, where, "exec")


def test_docs_have_examples():
    assert len(RUNNABLE) >= 5
