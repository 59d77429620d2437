"""HTML for Snakemake's report (`snakemake --report results/report.html`): standalone pages for the tables, the
run inventory and DEVIATIONS.md, and the caption each report item carries (what it shows, at which scale).

Each page is self-contained (inline CSS, no scripts, no external files): the report embeds it as it is.
"""
from __future__ import annotations

import html
import os
import re
from pathlib import Path

from fedcore.io import atomic_path
from fedcore.papers import PAPERS, paper_title  # noqa: F401 - paper_title: inventory.py imports it from here

# The line every table and figure of a scale carries, where the scale's numbers are no results at all (written by
# fedcore/report/render.py, the one place every table and figure passes through; the captions below quote it)
SCALE_BANNERS = {"smoke": "smoke: synthetic data, not results"}

SCALE_CAPTIONS = {
    "mini": ("Scale mini: embedded analogue data and tiny pretrained backbones on CPU; the numbers check the "
             "pipeline end to end and are not comparable to the paper's (its numbers are a layout reference only)."),
    "paper": "Scale paper: the paper's datasets, backbones and budgets; where a table shows Δ, Δ = ours − paper.",
    "smoke": (f"Scale {SCALE_BANNERS['smoke']}: the paper's experiments, backbones (random weights where a weight "
              "file is missing) and partitions, one round on synthetic data in each dataset's shape; it checks "
              "that the paper-scale code runs, nothing more."),
}

CSS = """
body { font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; font-size: 13px; color: #222; margin: 12px; }
p.caption { font-size: 14px; margin: 0 0 6px 0; max-width: 1000px; }
figcaption.caption { font-size: 13px; margin: 6px 0 0 0; max-width: 1000px; }
table { border-collapse: collapse; margin: 6px 0 10px 0; }
th, td { border: 1px solid #c8c8c8; padding: 2px 5px; }
th { background: #eef1f5; font-weight: 600; text-align: center; white-space: nowrap; }
td { text-align: right; white-space: nowrap; overflow-wrap: normal; }
td.label, th.label, td:first-child, th:first-child { text-align: left; }
td.attr { text-align: center; }
td.paper { color: #555; background: #fafafa; }
td.diff { color: #444; font-style: italic; }
td.missing { color: #b00; }
tbody tr:hover td { background: #fff8d8; }
.notes { font-size: 12px; color: #444; max-width: 1000px; }
.notes p { margin: 2px 0; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 22px; } h3 { font-size: 15px; }
code { background: #f3f3f3; padding: 0 2px; }
.toc { font-size: 12px; } .toc ul { margin: 2px 0; }
li { margin: 1px 0; }
body { overflow-wrap: anywhere; }
th.col { white-space: normal; min-width: 4.5em; max-width: 8.5em; vertical-align: bottom; }
tr.res th { font-weight: normal; font-size: 11px; color: #555; background: #f6f7f9; }
th .flag { color: #a35200; font-weight: normal; font-size: 11px; }
td.cell { text-align: right; line-height: 1.25; }
td.cell span { display: block; white-space: nowrap; }
td.cell span.paper { color: #777; font-size: 11px; }
td.cell span.diff { color: #444; font-size: 11px; font-style: italic; }
td.cell span.missing { color: #b00; }
span.ours[title] { cursor: help; }
.md th { white-space: normal; max-width: 9em; vertical-align: bottom; }
.md td { white-space: normal; max-width: 40em; }
.md td { text-align: left; }
p.legend { font-size: 12px; color: #444; margin: 0 0 6px 0; max-width: 1000px; }
p.part { font-size: 12px; font-weight: 600; margin: 10px 0 2px 0; }
"""


def page(title: str, body: str) -> str:
    """A complete, self-contained HTML document."""
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{html.escape(title)}</title>\n"
            f"<style>{CSS}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n")


def scale_caption(scale: str) -> str:
    """The sentence that says at which scale an output was made and how to read it."""
    if scale not in SCALE_CAPTIONS:
        raise ValueError(f"unknown scale {scale!r}; expected one of {sorted(SCALE_CAPTIONS)}")
    return SCALE_CAPTIONS[scale]


_RST_SPECIAL = re.compile(r"([\\`*_|\[\]<>])")


def rst_escape(text: str) -> str:
    """Plain text that reStructuredText prints literally (no emphasis, roles, links or substitutions)."""
    return _RST_SPECIAL.sub(r"\\\1", " ".join(str(text).split()))


def report_caption(caption: str, scale: str, what: str = "") -> str:
    """A report item's caption as reStructuredText: the config's caption, what the item is (if given), and the
    scale sentence."""
    parts = [caption.strip(), what.strip(), scale_caption(scale)]
    return rst_escape(" ".join(p for p in parts if p))


def inline_markdown(text: str) -> str:
    """Escaped text with Markdown's **bold** and `code` kept."""
    out = html.escape(text, quote=False)
    out = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", out)


def _two_space_lists(text: str) -> str:
    """Our Markdown nests lists by 2 spaces (as GitHub reads it); Python-Markdown needs 4: double every leading
    indentation outside fenced code."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        stripped = line.lstrip(" ")
        out.append(line if fenced else " " * (2 * (len(line) - len(stripped))) + stripped)
    return "\n".join(out) + "\n"


def markdown_html(text: str, toc: bool = False) -> str:
    """Markdown (tables, code, lists nested by 2 spaces, headings with anchors) as an HTML fragment; with ``toc``,
    a linked list of the second-level headings first."""
    import markdown

    md = markdown.Markdown(extensions=["tables", "fenced_code", "toc", "sane_lists"],
                           extension_configs={"toc": {"toc_depth": "2-2"}})
    body = f'<div class="md">{md.convert(_two_space_lists(text))}</div>'
    return (f'<nav class="toc"><strong>Contents</strong>{md.toc}</nav>\n{body}' if toc else body)


def write_html(path: str | os.PathLike, title: str, body: str) -> None:
    """Write a page atomically."""
    with atomic_path(Path(path)) as tmp:
        Path(tmp).write_text(page(title, body), encoding="utf-8")


def write_markdown_table_html(md_text: str, path: str | os.PathLike, title: str) -> None:
    """A table page from the Markdown the table's writer produced (caption, pipe table, notes): for the kinds
    whose layout is not ours-beside-paper columns (parameter counts, dataset statistics)."""
    write_html(path, title, markdown_html(md_text))


def write_markdown_page(md_path: str | os.PathLike, out: str | os.PathLike, title: str, toc: bool = False) -> None:
    """A Markdown file (DEVIATIONS.md with a linked table of contents; a claim check; a scorecard) as one page."""
    text = Path(md_path).read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{md_path} is empty; expected Markdown text for the report page {title!r}")
    write_html(out, title, markdown_html(text, toc=toc))


_PAPER_PREFIX = re.compile(r"^(" + "|".join(map(re.escape, PAPERS.values())) + r")\s+")


def output_title(caption: str, name: str) -> str:
    """A table's or figure's short title from its caption ('SGPT Table 1: ...' -> 'Table 1'); else its name."""
    head = _PAPER_PREFIX.sub("", caption.strip())
    if ":" in head and re.match(r"(Table|Fig\.)\s", head):
        return head.split(":", 1)[0].strip()
    return name


def output_description(caption: str, limit: int = 90) -> str:
    """The caption after its title, cut at ``limit`` characters (a report listing's second column)."""
    text = _PAPER_PREFIX.sub("", " ".join(caption.split()))
    if ":" in text and re.match(r"(Table|Fig\.)\s", text):
        text = text.split(":", 1)[1].strip()
    return text if len(text) <= limit else text[:limit - 1].rsplit(" ", 1)[0] + " …"


def title_key(title: str) -> tuple:
    """Natural order of titles: tables before figures, then by number ('Table 2' < 'Table 10', 'A2' < 'A10')."""
    kind = 0 if title.startswith("Table") else 1 if title.startswith("Fig") else 2
    parts = re.split(r"(\d+)", title)
    return (kind, [int(p) if p.isdigit() else p for p in parts])


PAPER_ORDER = tuple(PAPERS)  # the report's sections, in the registry's order (the README's)


def report_category(paper: str | None) -> str:
    """A report section's name, numbered so that Snakemake's alphabetical menu lists the papers in PAPER_ORDER and
    the deviations last (None: the deviations)."""
    if paper is None:
        return f"{len(PAPER_ORDER) + 1}. Choices and deviations"
    rank = PAPER_ORDER.index(paper) + 1 if paper in PAPER_ORDER else len(PAPER_ORDER) + 1
    return f"{rank}. {paper_title(paper)}"


def figure_page(png: str | os.PathLike, out: str | os.PathLike, title: str, caption: str, scale: str) -> None:
    """A figure as a report page: the PNG (embedded) with its caption and the scale sentence visible under it."""
    import base64

    data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
    body = (f'<figure style="margin: 0"><img src="data:image/png;base64,{data}" alt="{html.escape(title)}" '
            f'style="max-width: 100%; height: auto">'
            f'<figcaption class="caption">{inline_markdown(caption)} <em>{html.escape(scale_caption(scale))}</em>'
            '</figcaption></figure>')
    write_html(out, title, body)


def copy_page(src: str | os.PathLike, out: str | os.PathLike) -> None:
    """Copy a page atomically (a report item of its own, so that the report shows its caption, not the params of
    the job that built it)."""
    with atomic_path(Path(out)) as tmp:
        Path(tmp).write_bytes(Path(src).read_bytes())
