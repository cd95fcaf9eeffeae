"""The docs stay whole: a short README that links to pages that exist, and an API
reference with an entry for every public name.

Most checks need no mkdocs: they read README.md, mkdocs.yml and docs/ as text, and
the public modules' ``__all__`` by importing them.  The built site's checks (no reST
role shown as text, no dead internal link) build it with the docs venv's mkdocs
(``.venv-docs``, which ``.ci/run`` makes first), and skip, saying so, without it.
Each check is a function that returns what is wrong, tested on the real files and
on a broken input.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MKDOCS = ROOT / "mkdocs.yml"
DOCS = ROOT / "docs"

# Every module whose ``__all__`` the API reference documents, one ``::: module.name`` each.
PUBLIC_MODULES = (
    "dtcompile",
    "dtcompile.testing",
    "dtcompile.auto_parallel",
    "dtcompile.hops",
    "dynamo_vars",
    "dtcompile_tools.report",
)
README_MAX_LINES = 150

_ENTRY = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)
# A Markdown link's target: [text](target) or [text](target#anchor).
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# A nav line of mkdocs.yml: "  - Title: page.md" or "  - page.md".
_NAV_PAGE = re.compile(r"^\s*-\s+(?:[^:\n]*:\s+)?([\w./-]+\.md)\s*$", re.MULTILINE)


def reference_entries(texts: list[str]) -> set[str]:
    """The identifiers of the ``::: identifier`` entries in these Markdown texts."""
    return {name for text in texts for name in _ENTRY.findall(text)}


def missing_entries(exports: dict[str, list[str]], entries: set[str]) -> list[str]:
    """``module.name`` for every exported name with no reference entry."""
    return [f"{module}.{name}" for module, names in exports.items() for name in names if f"{module}.{name}" not in entries]


def readme_doc_links(text: str) -> list[str]:
    """The relative links into docs/ (``docs/....md``, anchor dropped)."""
    return [target.split("#")[0] for target in _LINK.findall(text) if target.startswith("docs/") and target.split("#")[0].endswith(".md")]


def nav_pages(mkdocs_yml: str) -> list[str]:
    """The pages of mkdocs.yml's ``nav:`` (relative to docs/)."""
    match = re.search(r"^nav:\s*$(.*?)(?=^\S|\Z)", mkdocs_yml, re.MULTILINE | re.DOTALL)
    assert match, "mkdocs.yml has no nav: section"
    return _NAV_PAGE.findall(match.group(1))


def missing_files(paths: list[str], root: Path) -> list[str]:
    return [path for path in paths if not (root / path).is_file()]


def _exports() -> dict[str, list[str]]:
    return {module: list(importlib.import_module(module).__all__) for module in PUBLIC_MODULES}


def _reference_texts() -> list[str]:
    return [path.read_text() for path in sorted((DOCS / "reference").glob("*.md"))]


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines (limit {README_MAX_LINES}): move the prose into a docs/ page and link to it"
    )


def test_every_public_name_has_a_reference_entry():
    missing = missing_entries(_exports(), reference_entries(_reference_texts()))
    assert not missing, f"no '::: name' entry in docs/reference/*.md for: {', '.join(missing)}"


def test_readme_links_into_docs_exist():
    links = readme_doc_links(README.read_text())
    assert links, "README.md links to no docs/ page"
    missing = missing_files(links, ROOT)
    assert not missing, f"README.md links to docs pages that do not exist: {missing}"


def test_every_nav_page_exists():
    pages = nav_pages(MKDOCS.read_text())
    assert "index.md" in pages, pages
    missing = missing_files(pages, DOCS)
    assert not missing, f"mkdocs.yml's nav names pages that do not exist in docs/: {missing}"


def code_blocks(markdown: str, language: str) -> list[str]:
    """The fenced code blocks of ``language`` in ``markdown``, their text without the fences."""
    return re.findall(rf"^```{language}\n(.*?)^```$", markdown, flags=re.MULTILINE | re.DOTALL)


def test_readme_test_commands_are_the_ci_commands():
    tests = [b for b in code_blocks(README.read_text(), "bash") if "autoparallel" in b and "pytest" in b]
    assert len(tests) == 1, "README.md lost its test commands (## Two commands)"
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"(\nset -e\n{tests[0]})\n" in ci, (
        "README.md's test commands differ from the ones .ci/run runs: keep the two byte-identical"
    )


def test_readme_quick_start_is_one_complete_program():
    programs = code_blocks(README.read_text(), "python")
    assert len(programs) == 1, "README.md's quick start is one runnable program (tests/testing/test_readme.py runs it)"
    assert "run_threaded(" in programs[0] and "dtcompile.explain" in programs[0]


# The checks themselves fail where they should.


def test_a_name_without_an_entry_is_named():
    entries = reference_entries(["::: pkg.a\n    options:\n      members: false\n", "text ::: not.an.entry\n"])
    assert entries == {"pkg.a"}
    assert missing_entries({"pkg": ["a", "b"]}, entries) == ["pkg.b"]


def test_a_missing_page_is_named(tmp_path):
    (tmp_path / "there.md").write_text("# there\n")
    links = readme_doc_links("[a](docs/there.md) [b](docs/gone.md#x) [c](benchmarks/RESULTS.md) [d](https://x/docs/y.md)")
    assert links == ["docs/there.md", "docs/gone.md"]
    assert missing_files(["there.md", "gone.md"], tmp_path) == ["gone.md"]
    nav = "site_name: x\nnav:\n  - Home: index.md\n  - Guides:\n      - One: guides/one.md\n  - two.md\nplugins:\n  - search\n"
    assert nav_pages(nav) == ["index.md", "guides/one.md", "two.md"]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_module_declares_all(module):
    assert importlib.import_module(module).__all__, f"{module} has an empty __all__"


# ---- the built site

_RAW_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):(?:<code>|`)")
_HREF = re.compile(r'href="([^"#?]*)[^"]*"')


def raw_roles(html: str) -> list[str]:
    """reST roles a page shows as text (outside code blocks)."""
    text = re.sub(r"<pre\b.*?</pre>", "", html, flags=re.DOTALL)
    return [text[max(m.start() - 30, 0):m.end() + 30] for m in _RAW_ROLE.finditer(text)]


def dead_links(site: Path) -> list[str]:
    """``page -> target`` for every link between the site's pages whose target is not in the site."""
    found = []
    for page in sorted(site.rglob("*.html")):
        for target in _HREF.findall(page.read_text()):
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
                continue  # an anchor on the page, or another site
            path = (site / target.lstrip("/") if target.startswith("/") else page.parent / target).resolve()
            if target.endswith("/") or path.is_dir():
                path = path / "index.html"
            if not path.exists():
                found.append(f"{page.relative_to(site)} -> {target}")
    return found


def _hook():
    spec = importlib.util.spec_from_file_location("rst_roles", DOCS / ".hooks" / "rst_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_hook_links_roles_it_can_resolve_and_leaves_code_blocks_alone():
    known = {"pkg.mod.f": "../mod/#pkg.mod.f", "pkg.mod.C.run": "#pkg.mod.C.run"}
    html = (
        '<h2 id="pkg.mod.C">C</h2><p>See :func:<code>pkg.mod.f</code>, :meth:<code>run</code> and '
        ":class:<code>~pkg.other.D</code>, as follows::</p><pre>:func:<code>kept</code></pre>"
    )
    out = _hook().convert(html, known.get)
    assert out == (
        '<h2 id="pkg.mod.C">C</h2><p>See <a class="autorefs autorefs-internal" href="../mod/#pkg.mod.f"><code>pkg.mod.f</code></a>, '
        '<a class="autorefs autorefs-internal" href="#pkg.mod.C.run"><code>run</code></a> and <code>D</code>, as follows:</p>'
        "<pre>:func:<code>kept</code></pre>"
    )
    assert raw_roles(out) == [] and raw_roles(html) != []


def test_a_raw_role_and_a_dead_link_are_found(tmp_path):
    assert raw_roles("<p>x :func:<code>f</code> y</p><pre>:class:`kept`</pre>") == ["<p>x :func:<code>f</code> y</p>"]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "index.html").write_text('<a href="../b/">b</a> <a href="../a/#top">a</a> <a href="https://x">x</a>')
    (tmp_path / "index.html").write_text('<a href="a/">a</a> <a href="c.png">c</a>')
    assert dead_links(tmp_path) == ["a/index.html -> ../b/", "index.html -> c.png"]


@pytest.mark.subprocess
def test_the_built_site_shows_no_role_as_text_and_has_no_dead_link(tmp_path):
    mkdocs = ROOT / ".venv-docs" / "bin" / "mkdocs"
    if not mkdocs.exists():
        pytest.skip("no docs venv (.venv-docs, made by .ci/run: python3 -m venv .venv-docs && "
                    ".venv-docs/bin/pip install -r docs/requirements.txt)")
    built = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-3000:]
    roles = {str(p.relative_to(tmp_path)): found for p in (tmp_path / "site").rglob("*.html") if (found := raw_roles(p.read_text()))}
    assert roles == {}, f"reST roles shown as text: {roles}"
    assert dead_links(tmp_path / "site") == []
    assert not (tmp_path / "site" / "requirements.txt").exists()
