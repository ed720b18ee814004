"""The report as a list of blocks (headings, paragraphs, tables, images), and its
two renderings: Markdown beside the PNGs, and one self-contained HTML page with the
PNGs embedded as base64, so the page needs no network and no scripts."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Heading:
    text: str


@dataclass(frozen=True)
class Paragraph:
    text: str


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: list[tuple[str, ...]]


@dataclass(frozen=True)
class Image:
    path: Path
    caption: str


Block = Heading | Paragraph | Table | Image


# Where Markdown would start raw HTML: "<" before a tag name, "/", "!" or "?" (CommonMark).
# Only these are escaped, so that text such as "margin <= 0.5" reads as written.
_RAW_HTML = re.compile(r"<(?=[A-Za-z/!?])")


def _markdown_text(text: str) -> str:
    """Text as Markdown that a renderer shows as text: a plan name or path from a run's
    manifest must never become markup in report.md."""
    return _RAW_HTML.sub("&lt;", text)


def _markdown_table(table: Table) -> str:
    def line(cells: tuple[str, ...]) -> str:
        escaped = (_markdown_text(c).replace("|", "\\|").replace("\n", " ") for c in cells)
        return "| " + " | ".join(escaped) + " |"

    return "\n".join(
        [line(table.header), line(tuple("---" for _ in table.header)), *map(line, table.rows)]
    )


def to_markdown(blocks: list[Block], out_dir: Path) -> str:
    """Markdown that links each image relative to out_dir, where report.md is written."""
    parts = []
    for i, block in enumerate(blocks):
        if isinstance(block, Heading):
            parts.append(("# " if i == 0 else "## ") + _markdown_text(block.text))
        elif isinstance(block, Paragraph):
            parts.append(_markdown_text(block.text))
        elif isinstance(block, Table):
            parts.append(_markdown_table(block))
        else:
            caption = _markdown_text(block.caption)
            parts.append(
                f"![{caption}]({block.path.relative_to(out_dir).as_posix()})\n\n*{caption}*"
            )
    return "\n\n".join(parts) + "\n"


HTML_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto;
       max-width: 1100px; color: #222; line-height: 1.45; padding: 0 1rem; }
table { border-collapse: collapse; margin: 0.8rem 0 1.4rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
figure { margin: 0.8rem 0 1.6rem; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85rem; color: #555; }
code { background: #f4f4f4; padding: 0 0.2rem; }
"""


def _html_text(text: str) -> str:
    """Escape, then render the only inline markup the blocks use: `code`."""
    pieces = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


def to_html(blocks: list[Block]) -> str:
    """One self-contained page: images inlined as base64, the first heading as title."""
    body = []
    title = ""
    for i, block in enumerate(blocks):
        if isinstance(block, Heading):
            title = title or block.text
            tag = "h1" if i == 0 else "h2"
            body.append(f"<{tag}>{_html_text(block.text)}</{tag}>")
        elif isinstance(block, Paragraph):
            body.append(f"<p>{_html_text(block.text)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_html_text(c)}</th>" for c in block.header)
            rows = "".join(
                "<tr>" + "".join(f"<td>{_html_text(c)}</td>" for c in row) + "</tr>"
                for row in block.rows
            )
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        else:
            data = base64.b64encode(block.path.read_bytes()).decode("ascii")
            alt = html.escape(block.caption)
            body.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{alt}">'
                f"<figcaption>{_html_text(block.caption)}</figcaption></figure>"
            )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{HTML_STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )
