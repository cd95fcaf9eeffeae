"""An MkDocs hook: the docstrings' reST markup rendered as the site's own.

The library's docstrings are reST-flavoured: ``:func:`name``` roles and a ``::`` that
opens a literal block.  mkdocstrings (docstring style ``sphinx``) reads their fields
but leaves the roles as text (``:func:<code>name</code>``).  After the cross-references
are resolved (``on_env``, after mkdocs-autorefs'), each role becomes a link to the
object's entry in the API reference where one documents it, looked up as written, then
relative to the objects the page documents above it (a method named by its class's
docstring), and plain code otherwise; a paragraph's closing ``::`` becomes ``:``.
Code blocks are left alone.  ``tests/architecture/test_docs.py`` builds the site and
fails on any role left as text.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_TOKEN = re.compile(
    r"(?P<pre><pre\b.*?</pre>)"
    r'|id="(?P<anchor>[A-Za-z_][\w.]*)"'
    r"|:(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):<code>(?P<short>~?)\.?(?P<target>[\w.]+)(?P<call>\(\))?</code>"
    r"|(?P<literal>::)(?=</p>)",
    flags=re.DOTALL,
)


def candidates(target: str, context: str) -> list[str]:
    """Where ``target`` may be documented: as written, then under ``context`` (the object
    documented above it on the page) and each of its parents."""
    found = [target]
    parts = context.split(".") if context else []
    while parts:
        found.append(".".join([*parts, target]))
        parts.pop()
    return found


def convert(html: str, resolve: Callable[[str], str | None]) -> str:
    """``html`` with its reST roles as links (``resolve``: identifier -> URL, or ``None``) or code,
    and a paragraph's closing ``::`` as ``:``; ``<pre>`` blocks unchanged."""
    out: list[str] = []
    context = ""
    pos = 0
    for match in _TOKEN.finditer(html):
        out.append(html[pos:match.start()])
        pos = match.end()
        if match["pre"] is not None:
            out.append(match["pre"])
        elif match["anchor"] is not None:
            context = match["anchor"]
            out.append(match.group(0))
        elif match["literal"] is not None:
            out.append(":")
        else:
            target = match["target"]
            shown = (target.rsplit(".", 1)[-1] if match["short"] else target) + (match["call"] or "")
            url = next((u for c in candidates(target, context) if (u := resolve(c)) is not None), None)
            code = f"<code>{shown}</code>"
            out.append(f'<a class="autorefs autorefs-internal" href="{url}">{code}</a>' if url else code)
    out.append(html[pos:])
    return "".join(out)


def on_env(env, config, files):  # noqa: ANN001, ANN201 (MkDocs' hook signature)
    autorefs = config.plugins.get("autorefs")

    for file in files.documentation_pages():
        page = file.page
        if page is None or not page.content:
            continue

        def resolve(identifier: str, page=page) -> str | None:  # noqa: ANN001
            try:
                return autorefs.get_item_url(identifier, from_url=page.url)[0]
            except Exception:  # not documented on the site
                return None

        page.content = convert(page.content, resolve)
    return env
