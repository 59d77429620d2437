"""The HTML report's pages: a table page (ours beside the paper's, Δ at paper scale), the run inventory, a
Markdown page, and the captions Snakemake's report renders as reStructuredText."""
from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
from docutils.core import publish_parts

from fedcore.report.html_pages import report_caption, write_markdown_page
from fedcore.report.inventory import INCOMPLETE, MISSING, PRESENT, build_inventory, empty_cells, write_inventory
from fedcore.report.tables import MINI_NOTE, build_table, write_table
from test_report import EXPERIMENTS, IMPLEMENTED, TABLE_CFG, run_frame, sample_metrics


class Cells(HTMLParser):
    """Rows of the first table as lists of (tag, text, attributes)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[tuple[str, str, dict]]] = []
        self._cell = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = (tag, [], dict(attrs))

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[1].append(data)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append((self._cell[0], "".join(self._cell[1]).strip(), self._cell[2]))
            self._cell = None


def _rows(html_text: str) -> list[list[tuple[str, str, dict]]]:
    parser = Cells()
    parser.feed(html_text)
    return parser.rows


class Spans(HTMLParser):
    """The text of every <span> inside a table cell, by row: (cell index, span class, text)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[tuple[int, str, str]]] = []
        self._cell, self._span = -1, None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
            self._cell = -1
        elif tag in ("td", "th"):
            self._cell += 1
        elif tag == "span" and self.rows:
            self._span = [dict(attrs).get("class", ""), ""]

    def handle_data(self, data):
        if self._span is not None:
            self._span[1] += data
        elif self.rows and data.strip() and self._cell >= 0:
            self.rows[-1].append((self._cell, "text", data.strip()))

    def handle_endtag(self, tag):
        if tag == "span" and self._span is not None:
            self.rows[-1].append((self._cell, self._span[0], self._span[1].strip()))
            self._span = None


@pytest.mark.parametrize("scale", ["mini", "paper"])
def test_table_page_puts_ours_above_the_papers_and_the_difference_at_paper_scale(tmp_path: Path, scale):
    table = build_table(sample_metrics(scale), TABLE_CFG, EXPERIMENTS, scale, IMPLEMENTED)
    out = [tmp_path / "t.md", tmp_path / "t.tex", tmp_path / "t.csv", tmp_path / "t.html"]
    write_table(table, TABLE_CFG, scale, *out)
    page = out[3].read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page and "<script" not in page
    rows = _rows(page)
    assert [c[1] for c in rows[0]] == ["Method"] + [c["label"] for c in TABLE_CFG["columns"]]  # one per column
    parser = Spans()
    parser.feed(page)
    body = {r[0][2]: r for r in parser.rows[1:] if r and r[0][1] == "text"}   # [0]: the header
    assert list(body) == ["fedavg", "head_tune", "fedvpt", "local", "sgpt"]
    fedavg = [(cls, text) for cell, cls, text in body["fedavg"] if cell == 1]
    assert fedavg[:2] == [("ours", "72.00 ± 2.00"), ("paper", "80.00")]
    if scale == "paper":
        assert fedavg[2] == ("diff", "Δ -8.00") and MINI_NOTE not in page
    else:
        assert len(fedavg) == 2 and MINI_NOTE in page
    assert ("ours missing", "not implemented") in [(cls, text) for cell, cls, text in body["sgpt"] if cell == 1]
    # every number of the Markdown table is on the page
    md_numbers = {c.strip().strip("*") for line in out[0].read_text().splitlines()
                  if line.startswith("| ") and not line.startswith("| Method") for c in line.split("|")[2:-1]}
    shown = {text.removeprefix("Δ ") for r in parser.rows for _, _, text in r}
    assert md_numbers <= shown


def test_a_wide_table_is_split_into_parts_that_repeat_the_row_labels():
    from fedcore.report.table_html import column_parts

    a2 = [f"Off. {d}" for d in "ACDW"] + ["Off. Avg."] + [f"DN {d}" for d in "CIPQRS"] + ["DN Avg."]
    assert [len(p) for p in column_parts(a2, 8)] == [5, 7]                 # split between the datasets
    t1 = [f"C100 {m} s={s}" for m in ("Global", "Local", "Worst") for s in (50, 10)] + ["Five G", "Five L", "Five W"]
    assert [len(p) for p in column_parts(t1, 8)] == [6, 3]
    assert [len(p) for p in column_parts([f"c{i}" for i in range(12)], 8)] == [6, 6]   # no groups: equal parts
    assert [len(p) for p in column_parts(["a"] * 8, 8)] == [8]
    wide = {**TABLE_CFG, "columns": TABLE_CFG["columns"] * 2}    # 10 columns
    wide["paper"] = {r: v * 2 for r, v in TABLE_CFG["paper"].items()}
    table = build_table(sample_metrics("mini"), wide, EXPERIMENTS, "mini", IMPLEMENTED)
    from fedcore.report.tables import render_html

    page = render_html(table, wide, "mini")
    assert page.count("<table>") == 2 and "Part 1 of 2" in page and "Part 2 of 2" in page
    assert page.count('<td class="label">fedavg</td>') == 2


def test_inventory_tells_present_incomplete_and_missing_runs_and_empty_cells(tmp_path: Path):
    metrics = pd.concat([run_frame("exp_a", "fedavg", 0, {1: 0.5, 5: 0.6, 6: 0.7}),
                         run_frame("exp_a", "local", 0, {1: 0.5, 2: 0.6}),
                         run_frame("exp_a", "fedavg", 0, {1: 0.5, 6: 0.7}, scale="paper")], ignore_index=True)
    diverged = metrics.loc[(metrics["method"] == "local") & (metrics["metric"] == "loss")].assign(metric="diverged")
    metrics = pd.concat([metrics, diverged], ignore_index=True)  # rounds 1 and 2: NaN/inf in the trained state
    runs = [{"experiment": "exp_a", "method": m, "seed": 0, "rounds": 6} for m in ("fedavg", "local", "head_tune")]
    inv = build_inventory(metrics, runs, "mini").set_index("method")
    assert inv["status"].to_dict() == {"fedavg": PRESENT, "local": INCOMPLETE, "head_tune": MISSING}
    assert inv.loc["local", "diverged_from"] == 1 and inv["diverged_from"].isna().sum() == 2
    assert inv.loc["fedavg", "evaluated_rounds"] == 3 and inv.loc["local", "last_round"] == 2
    assert pd.isna(inv.loc["head_tune", "last_round"]) and inv.loc["head_tune", "evaluated_rounds"] == 0
    table = build_table(sample_metrics(), TABLE_CFG, EXPERIMENTS, "mini", IMPLEMENTED)
    table.to_csv(tmp_path / "t1.csv", index=False)
    cells = empty_cells({"t1": tmp_path / "t1.csv"})
    assert ("t1", "sgpt", "A Global", "not implemented") in set(cells.itertuples(index=False, name=None))
    metrics.to_parquet(tmp_path / "m.parquet")
    write_inventory(tmp_path / "m.parquet", runs, {"t1": tmp_path / "t1.csv"}, "sgpt", "mini", tmp_path / "r.html",
                    tmp_path / "r.csv", {"fedavg": "FedAvg"})
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "3 configured runs: 1 present, 1 incomplete" in page and "1 missing" in page
    assert "FedAvg <code>fedavg</code>" in page and "1 diverged (a NaN or an infinity" in page
    assert "incomplete: 2/6 rounds, 2 evaluated, diverged (NaN/inf) from round 1" in page
    assert pd.read_csv(tmp_path / "r.csv")["status"].tolist() == [PRESENT, INCOMPLETE, MISSING]


def test_caption_is_literal_rst_with_the_scale(tmp_path: Path):
    text = "Fig. *1*: `α_g` | s=10, [ref]_ <b>"
    html = publish_parts(report_caption(text, "mini"), writer="html")["body"]
    assert "Fig. *1*: `α_g` | s=10, [ref]_ &lt;b&gt;" in html and "Scale mini:" in html
    assert "<em>" not in html and "<a " not in html and "problematic" not in html
    with pytest.raises(ValueError, match="huge"):
        report_caption(text, "huge")


def test_markdown_page_has_a_linked_table_of_contents_and_refuses_an_empty_file(tmp_path: Path):
    (tmp_path / "d.md").write_text("# Title\n\n## Scales\n\n* **mini** is `small`:\n  * nested by two spaces\n"
                                   "  wrapped line\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    write_markdown_page(tmp_path / "d.md", tmp_path / "d.html", "Deviations", toc=True)
    page = (tmp_path / "d.html").read_text(encoding="utf-8")
    assert '<a href="#scales">Scales</a>' in page and '<h2 id="scales">' in page and 'href="#title"' not in page
    assert "<code>small</code>:<ul>\n<li>nested by two spaces" in page
    assert "<strong>mini</strong>" in page and "<code>small</code>" in page and "<td>2</td>" in page
    (tmp_path / "e.md").write_text("\n")
    with pytest.raises(ValueError, match="e.md is empty"):
        write_markdown_page(tmp_path / "e.md", tmp_path / "e.html", "Empty")
    assert not (tmp_path / "e.html").exists()


def test_report_items_are_titled_ordered_and_sectioned_in_the_papers_order():
    from fedcore.report.html_pages import output_description, output_title, report_category, title_key

    assert output_title("SGPT Table 1: CIFAR-100 (s=50, s=10) and Five-dataset; accuracy", "t1") == "Table 1"
    assert output_title("FedHPL Fig. 3(a) / Fig. 11: prompt length n", "f") == "Fig. 3(a) / Fig. 11"
    assert output_title("Global accuracy per round for each method.", "sgpt_accuracy_per_round") == \
        "sgpt_accuracy_per_round"
    assert output_description("SGPT Table 1: CIFAR-100 (s=50, s=10) and Five-dataset") == \
        "CIFAR-100 (s=50, s=10) and Five-dataset"
    titles = ["Fig. 2", "Table 10(j)", "Table 2", "Table A10", "Table A2", "Table 1"]
    assert sorted(titles, key=title_key) == ["Table 1", "Table 2", "Table 10(j)", "Table A2", "Table A10", "Fig. 2"]
    sections = [report_category(p) for p in ("fedpft", "sgpt", "fedotp", "fedhpl")] + [report_category(None)]
    assert sorted(sections) == ["1. SGPT", "2. FedHPL", "3. FedOTP", "4. FedPFT", "5. Choices and deviations"]


def test_a_figure_page_shows_the_caption_and_scale_under_the_image(tmp_path: Path):
    from matplotlib.figure import Figure

    from fedcore.report.html_pages import figure_page

    fig = Figure(figsize=(2, 1))
    fig.subplots().plot([0, 1])
    fig.savefig(tmp_path / "f.png")
    figure_page(tmp_path / "f.png", tmp_path / "f.html", "Fig. 1", "SGPT Fig. 1: global vs. worst", "mini")
    page = (tmp_path / "f.html").read_text()
    assert page.index("<img") < page.index("<figcaption") and "SGPT Fig. 1: global vs. worst" in page
    assert "Scale mini" in page and "data:image/png;base64," in page
