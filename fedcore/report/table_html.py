"""A metrics table as the HTML report shows it: narrow enough for the report's frame (about 1,050 px in a 1,400 px
window). Each cell holds our number with the paper's below it (and Δ at scale paper) instead of one column each;
column labels wrap; a header row gives each column's test images; a table of more than MAX_COLUMNS columns is
split into parts that each repeat the row labels. Hovering our number shows its test images and interval."""
from __future__ import annotations

import html
import math

import pandas as pd

from fedcore.report.resolution import SEED_STD, WILSON
from fedcore.report.table_notes import DEGENERATE_MARK, column_sizes

MAX_COLUMNS = 8  # number columns a part holds: 8 × ~95 px + the labels fit the report's frame

_esc = lambda t: html.escape(str(t), quote=False)  # noqa: E731


def column_parts(labels: list[str], most: int = MAX_COLUMNS) -> list[range]:
    """Column positions in as few parts of at most ``most`` columns as possible. Parts break between groups of
    columns whose labels start alike ('C100 ...', 'Five ...'; 'Off. ...', 'DN ...') when every group fits a part;
    otherwise into near-equal parts."""
    n = len(labels)
    if n <= most:
        return [range(n)]
    starts = [0] + [j for j in range(1, n) if labels[j].split()[:1] != labels[j - 1].split()[:1]] + [n]
    groups = [range(a, b) for a, b in zip(starts, starts[1:])]
    if len(groups) < n and all(len(g) <= most for g in groups):   # labels do group, and every group fits
        out: list[range] = []
        for g in groups:
            if out and len(out[-1]) + len(g) <= most:
                out[-1] = range(out[-1].start, g.stop)
            else:
                out.append(g)
        return out
    parts = math.ceil(n / most)
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        out.append(range(start, stop))
        start = stop
    return out


def hover_text(cell: pd.Series) -> str:
    """What stands behind a number: its test images and its 95 % interval or its spread."""
    n = cell.get("test_images")
    parts = [f"{int(n)} test images ({cell['test_images_of']}; one image = {cell['step']:.2f} points)"
             if n is not None and not pd.isna(n) else str(cell.get("test_images_of", ""))]
    if cell.get("interval") == WILSON:
        parts.append(f"Wilson 95 % interval {cell['ci95_low']:.2f}–{cell['ci95_high']:.2f}")
    elif cell.get("interval") == SEED_STD:
        parts.append(f"mean ± std over {int(cell['n_seeds'])} seeds")
    return "; ".join(p for p in parts if p)


def _cell_html(cell: pd.Series, entries: list[tuple[str, bool]], scale: str) -> str:
    """One table cell: ours (bold if best; red if no number), the paper's below, Δ below that at scale paper."""
    (ours, bold), (paper, _) = entries[0], entries[1]
    ok = cell["status"] == "ok"
    inner = f"<strong>{_esc(ours)}</strong>" if bold else _esc(ours)
    title = f' title="{html.escape(hover_text(cell))}"' if ok and "test_images_of" in cell else ""
    out = f'<span class="ours{"" if ok else " missing"}"{title}>{inner}</span><span class="paper">{_esc(paper)}</span>'
    if scale == "paper":
        out += f'<span class="diff">Δ {_esc(entries[2][0])}</span>'
    return f'<td class="cell">{out}</td>'


def _header(columns: pd.DataFrame, attr_cols: list[str], row_header: str) -> str:
    """The column labels (with a column's degeneracy flag) and, where known, a row of test images per column."""
    th = [f'<th class="label">{_esc(row_header)}</th>'] + [f'<th class="attr">{_esc(a)}</th>' for a in attr_cols]
    res = ['<th class="label">test images</th>'] + ['<th class="attr"></th>' for _ in attr_cols]
    for c in columns.itertuples():
        flag = ""
        if c.degenerate:
            flag = f'<br><span class="flag">{DEGENERATE_MARK} {_esc(c.degenerate)}</span>'
        th.append(f'<th class="col">{_esc(c.column)}{flag}</th>')
        n = "" if pd.isna(c.n) else f'<span title="one image = {100.0 / int(c.n):.2f} points">{int(c.n)}</span>'
        res.append(f"<th>{n}</th>")
    rows = f"<tr>{''.join(th)}</tr>"
    if columns["n"].notna().any():
        rows += f'<tr class="res">{"".join(res)}</tr>'
    return f"<thead>{rows}</thead>"


def render_table_html(table: pd.DataFrame, table_cfg: dict, scale: str, grid, row_attributes, caption: str,
                      notes: list[str]) -> str:
    """The fragment: caption, a legend, the table (in parts when wide) and the notes. ``grid`` and
    ``row_attributes`` are tables.py's (row labels and per-row (text, bold) entries; extra text columns)."""
    from fedcore.report.html_pages import inline_markdown

    labels, entries = grid
    attr_cols, attr_rows = row_attributes
    per_cell = 3 if scale == "paper" else 2
    columns = column_sizes(table)
    cells = {(r, int(j)): c for (r, j), c in zip(zip(table["row"], table["col_index"]), table.to_dict("records"))}
    row_keys = list(dict.fromkeys(table["row"]))
    parts = column_parts(list(columns["column"]))
    out = []
    for k, part in enumerate(parts):
        body = []
        for i, (key, label, attrs) in enumerate(zip(row_keys, labels, attr_rows)):
            tds = [f'<td class="label">{_esc(label)}</td>'] + [f'<td class="attr">{_esc(a)}</td>' for a in attrs]
            for j in part:
                tds.append(_cell_html(pd.Series(cells[(key, j)]), entries[i][per_cell * j:per_cell * (j + 1)], scale))
            body.append(f"<tr>{''.join(tds)}</tr>")
        head = _header(columns.iloc[list(part)], attr_cols, table_cfg.get("row_header", "Method"))
        title = (f'<p class="part">Part {k + 1} of {len(parts)}: {_esc(columns["column"].iloc[part[0]])} to '
                 f'{_esc(columns["column"].iloc[part[-1]])}</p>') if len(parts) > 1 else ""
        out.append(f"{title}<table>{head}<tbody>{''.join(body)}</tbody></table>")
    legend = ("Each cell: our number (bold: the best of ours"
              + (" in its row" if table_cfg.get("best_in") == "row" else " in its column") + ") above the paper's"
              + (", then Δ = ours − paper" if scale == "paper" else " (grey)")
              + ". Hover our number for its test images and its 95 % interval.")
    return (f'<p class="caption">{caption}</p>\n<p class="legend">{_esc(legend)}</p>\n' + "\n".join(out)
            + f'\n<div class="notes">{"".join(f"<p>{inline_markdown(n)}</p>" for n in notes)}</div>')
