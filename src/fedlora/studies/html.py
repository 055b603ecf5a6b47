"""report.html beside report.md: the same text, tables and figures in one
self-contained page (no network, no files beside it: every PNG embedded as a base64 data
URI, SVG inline). Converts the subset of Markdown that `fedlora report` writes: headings,
paragraphs, pipe tables, fenced code, bullet lists, images, `code` and **bold**.

A short script writes into the page, once it has loaded, how many of its figures rendered
(`data-figures-rendered="k/n"` on <body>); tests/test_report_html.py reads it back from a
headless Chromium.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from fedlora.files import atomic_write

_IMAGE = re.compile(r"^!\[([^\]]*)\]\(([^)]+)\)$")
_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em;
       line-height: 1.45; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f3f3f3; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; height: auto; }
figcaption { font-size: 0.9em; color: #555; }
"""
_CHECK = """
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.querySelectorAll("figure img, figure svg"));
  var ok = imgs.filter(function (i) {
    return i.tagName.toLowerCase() === "svg" ? i.getBBox().width > 0
                                             : i.complete && i.naturalWidth > 0;
  });
  document.body.setAttribute("data-figures-rendered", ok.length + "/" + imgs.length);
});
"""


def _inline(text: str) -> str:
    """Escape, then `code` and **bold**."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def _figure(alt: str, src: str, base: Path) -> str:
    """The image at `base / src` embedded (PNG as a data URI, SVG inline); a visible note
    when the file is missing."""
    path = base / src
    caption = f"<figcaption>{html.escape(alt)} ({html.escape(src)})</figcaption>"
    if not path.is_file():
        return f"<p><em>missing figure: {html.escape(src)}</em></p>"
    if path.suffix.lower() == ".svg":
        svg = path.read_text(encoding="utf-8")
        svg = svg[svg.find("<svg") :]
        return f"<figure>{svg}{caption}</figure>"
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    mime = "image/png" if path.suffix.lower() == ".png" else "image/jpeg"
    alt_attr = html.escape(alt, quote=True)
    return f'<figure><img alt="{alt_attr}" src="data:{mime};base64,{data}">{caption}</figure>'


def markdown_to_html(text: str, base: Path, title: str = "fedlora report") -> str:
    """A whole HTML page from report.md's text; images are read relative to `base`."""
    body: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            body.append("<pre><code>" + html.escape("\n".join(lines[i + 1 : j])) + "</code></pre>")
            i = j + 1
        elif stripped.startswith("#"):
            level = min(len(stripped) - len(stripped.lstrip("#")), 6)
            body.append(f"<h{level}>{_inline(stripped[level:].strip())}</h{level}>")
            i += 1
        elif stripped.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            rows = [r for r in rows if not all(set(c) <= set("-: ") and c for c in r)]
            head, rest = rows[0], rows[1:]
            out = ["<table><thead><tr>"]
            out += [f"<th>{_inline(c)}</th>" for c in head]
            out.append("</tr></thead><tbody>")
            for r in rest:
                out.append("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>")
            body.append("".join(out) + "</tbody></table>")
        elif stripped.startswith(("- ", "* ")):
            items = []
            while i < len(lines) and lines[i].strip().startswith(("- ", "* ")):
                items.append(f"<li>{_inline(lines[i].strip()[2:])}</li>")
                i += 1
            body.append("<ul>" + "".join(items) + "</ul>")
        elif not stripped:
            i += 1
        else:
            parts = []
            while i < len(lines) and lines[i].strip() and not _block_start(lines[i].strip()):
                parts.append(lines[i].strip())
                i += 1
            images = [_IMAGE.match(p) for p in parts]
            if all(images):
                body += [_figure(m.group(1), m.group(2), base) for m in images if m]
            else:
                body.append("<p>" + _inline(" ".join(parts)) + "</p>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + f"\n<script>{_CHECK}</script>\n</body></html>\n"
    )


def _block_start(stripped: str) -> bool:
    return stripped.startswith(("#", "|", "```", "- ", "* "))


def write_html(report_md: Path) -> Path:
    """report.html beside `report_md`, its figures embedded; returns its path."""
    text = report_md.read_text(encoding="utf-8")
    first = next((x for x in text.splitlines() if x.startswith("# ")), "# fedlora report")
    out = report_md.with_suffix(".html")
    page = markdown_to_html(text, report_md.parent, first[2:].strip())
    atomic_write(out, page.encode("utf-8"))  # never through a link at report.html
    return out
