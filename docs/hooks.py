"""The docs site's build hooks (mkdocs ``hooks:``) and a griffe extension (mkdocstrings).

- :class:`SphinxRoles`: gpupipe's docstrings name things the Sphinx way (``:class:`~gpupipe.Loader```,
  ``:meth:`set_epoch```); mkdocstrings renders Markdown, so the roles become code spans; and their
  ``Example:`` sections become ``Examples:``, whose ``>>>`` lines griffe renders as code.
- ``on_page_markdown``: the Benchmarks page's ``<!-- results -->`` marker becomes every result in
  ``bench/results/`` (newest first), each with its machine and date as written there;
  ``on_files`` makes their plots part of the site.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import griffe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
_ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|obj|exc):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    """``:class:`~gpupipe.Loader``` → ```Loader```; without ``~``, the name as written."""
    name = match.group(2)
    return f"`{name.rsplit('.', 1)[-1] if match.group(1) else name}`"


_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.M)


class SphinxRoles(griffe.Extension):
    """Sphinx roles in docstrings → Markdown code spans; an ``Example:`` section → ``Examples:``,
    which griffe's Google parser splits into text and ``>>>`` code blocks (rendered as Python,
    not as Markdown quotes)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", _ROLE.sub(_role, obj.docstring.value))


def _results() -> str:
    """Every result file of ``bench/results/``, newest first: its title as a section, its body
    with headings one level down; plots point into the site, other links become plain text."""
    parts = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.md")), reverse=True):
        with open(path) as f:
            title, _, body = f.read().partition("\n")
        body = re.sub(r"^(#{1,5}) ", r"#\1 ", body, flags=re.M)
        body = re.sub(r"!\[([^\]]*)\]\(([^)/]+\.png)\)", r"![\1](results/\2)", body)
        body = re.sub(
            r"(?<!!)\[([^\]]+)\]\(([^)]+)\)", lambda m: m.group(0) if "://" in m.group(2) else m.group(1), body
        )
        parts.append(f"## {title.lstrip('# ').strip()}\n\n`bench/results/{os.path.basename(path)}`\n{body}")
    return "\n\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if "<!-- results -->" in markdown:
        return markdown.replace("<!-- results -->", _results())
    return markdown


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """The plots in ``bench/results/`` are part of the site, as ``benchmarks/results/<name>.png``
    (so that pages link them and the strict build checks those links)."""
    from mkdocs.structure.files import File

    for path in sorted(glob.glob(os.path.join(RESULTS, "*.png"))):
        files.append(File.generated(config, f"benchmarks/results/{os.path.basename(path)}", abs_src_path=path))
    return files
