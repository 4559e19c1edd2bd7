"""Every hook in core/hookspecs.py is a docstring-only spec, documented in docs/plugins.md
with its signature, and exercised by name in some test file."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from core import hookspecs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "plugins.md"
HOOKS = [name for name in vars(hookspecs) if name.startswith("zoo_")]
TEST_FILES = [
    p
    for p in (*ROOT.glob("tests/**/*.py"), *ROOT.glob("examples/*/tests/**/*.py"))
    if p.resolve() != Path(__file__).resolve()
]


def test_there_are_hooks():
    assert len(HOOKS) >= 4 and all(hasattr(getattr(hookspecs, h), "zoo_spec") for h in HOOKS)


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_a_docstring_only_spec(name):
    fn = getattr(hookspecs, name)
    (tree,) = ast.parse(textwrap.dedent(inspect.getsource(fn))).body
    assert len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr), f"{name}: body"
    assert inspect.getdoc(fn), f"{name} has no docstring"
    assert list(inspect.signature(fn).parameters) == ["registry"]


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_with_its_signature(name):
    signature = f"{name}{inspect.signature(getattr(hookspecs, name))}"
    assert f"### `{signature}`" in DOCS.read_text(), f"docs/plugins.md lacks ### `{signature}`"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_exercised_by_a_test(name):
    users = [p.relative_to(ROOT) for p in TEST_FILES if name in p.read_text()]
    assert users, f"no test file uses {name}"


def test_docs_document_no_other_hook():
    documented = re.findall(r"^### `(zoo_\w+)\(", DOCS.read_text(), re.MULTILINE)
    assert sorted(documented) == sorted(HOOKS)
