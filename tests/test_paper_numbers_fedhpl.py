"""Every FedHPL number that config/reports/fedhpl.yaml says "the paper reports" is printed in the paper's text.

A transcription guard, not a result check: each table's `paper:` values (and each param-count cell, converted
back to the paper's K = 2^10 / M = 2^20 units) are formatted with the paper's decimals and looked up in the
arXiv text, row by row where the PDF text keeps a table's row on one line (so a swapped or mistyped cell fails,
not only a number the paper never prints). Each claim's sentence must be quoted from the paper and its
`source` must name a section or appendix the paper has. Skips when the shared papers folder is absent.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT.parent / "shared" / "papers" / "fedhpl_arxiv2405.17267.txt"
REPORT = ROOT / "config" / "reports" / "fedhpl.yaml"

NUM = re.compile(r"(?<![\d.])\d+(?:\.\d+)?(?![\d])")


@pytest.fixture(scope="module")
def paper() -> dict:
    if not PAPER.is_file():
        pytest.skip(f"the paper's text is not here: {PAPER} (the shared folder beside the checkout)")
    text = PAPER.read_text(encoding="utf-8").replace("\xa0", " ")
    lines = text.split("\n")
    return {"text": text, "lines": lines, "tokens": [NUM.findall(line) for line in lines],
            "all": {t for toks in (NUM.findall(line) for line in lines) for t in toks}}


@pytest.fixture(scope="module")
def report() -> dict:
    return yaml.safe_load(REPORT.read_text(encoding="utf-8"))


def fmt(x: float, decimals: int) -> str:
    return f"{x:.{decimals}f}"


def contiguous_on_a_line(paper: dict, seq: list[str]) -> bool:
    """`seq` occurs as consecutive numbers of one line of the paper's text."""
    n = len(seq)
    return any(toks[i:i + n] == seq for toks in paper["tokens"] for i in range(len(toks) - n + 1))


# metrics tables whose every row is one line of the PDF text, in the config's column order
ROW_PER_LINE = ["fedhpl_table1", "fedhpl_table2", "fedhpl_table3d", "fedhpl_table3e", "fedhpl_table10j",
                "fedhpl_table10k", "fedhpl_table12", "fedhpl_table14"]


def table_decimals(table: dict) -> int:
    return int(table.get("decimals", 2))


@pytest.mark.parametrize("name", ROW_PER_LINE)
def test_metric_rows_are_lines_of_the_paper(paper, report, name):
    table = report["tables"][name]
    d = table_decimals(table)
    for row, values in table["paper"].items():
        seq = [fmt(v, d) for v in values]
        assert contiguous_on_a_line(paper, seq), f"{name} row {row}: {seq} is not a row of the paper's table"


def test_table11_rows(paper, report):
    """Table 11's PDF rows interleave the two uploads per dataset: IID/Dir/Non-IID x [C10 Avg, All, C100 ...]."""
    for name in ("fedhpl_table11l", "fedhpl_table11m"):
        p = report["tables"][name]["paper"]
        for s in range(3):   # IID, Dir, Non-IID; columns are C10 x3, C100 x3, SVHN x3
            seq = [fmt(p[r][3 * ds + s], 2) for ds in range(3) for r in ("hpl_average_upload", "fedhpl")]
            assert contiguous_on_a_line(paper, seq), f"{name} setting {s}: {seq} is not a row of Table 11"


def test_table13_rows(paper, report):
    """Table 13: one PDF line per (dataset, alpha); the config puts the three datasets side by side."""
    for row, values in report["tables"]["fedhpl_table13"]["paper"].items():
        assert len(values) == 18, row
        for block in range(3):
            seq = [fmt(v, 2) for v in values[6 * block:6 * block + 6]]
            assert contiguous_on_a_line(paper, seq), f"fedhpl_table13 {row} block {block}: {seq}"


def test_other_metric_numbers_are_printed(paper, report):
    """Tables whose numbers the text prints outside a one-line row (Table 9's cells, C.5.5's batch sizes)."""
    for name in ("fedhpl_table9", "fedhpl_batch_size"):
        table = report["tables"][name]
        d = table_decimals(table)
        for row, values in table["paper"].items():
            for v in values:
                if v is not None:
                    assert fmt(v, d) in paper["all"], f"{name} {row}: {fmt(v, d)} is not in the paper"


def test_every_metrics_table_is_checked(report):
    checked = set(ROW_PER_LINE) | {"fedhpl_table11l", "fedhpl_table11m", "fedhpl_table13", "fedhpl_table9",
                                   "fedhpl_batch_size"}
    with_numbers = {n for n, t in report["tables"].items() if "paper" in t}
    assert with_numbers == checked, f"add the new table(s) to this test: {sorted(with_numbers ^ checked)}"


# param-count tables: (unit, decimals) of the paper's printed cells; counts must round to a printed number
PARAM_UNITS = {"fedhpl_table5": [(2**20, 2), (2**20, 3)], "fedhpl_table6": [(2**10, 2)],
               "fedhpl_table7": [(2**20, 3)], "fedhpl_table8": [(2**10, 2)], "fedhpl_table8_32px": [(2**10, 2)]}


@pytest.mark.parametrize("name", sorted(PARAM_UNITS))
def test_param_counts_are_printed(paper, report, name):
    table = report["tables"][name]
    assert table.get("kind") == "param_count"
    for col in table["columns"]:
        shown = [fmt(col["paper"] / unit, d) for unit, d in PARAM_UNITS[name]]
        assert any(s in paper["all"] for s in shown), \
            f"{name} {col['method']} {col['architecture']}: {col['paper']} = {shown} is not in the paper"


def test_table7_rows(paper, report):
    """Table 7: each method's six counts (C10 R18/34/50, C100 R18/34/50) are one line of the paper, in order."""
    rows: dict[str, list[str]] = {}
    for col in report["tables"]["fedhpl_table7"]["columns"]:
        rows.setdefault(col["method"], []).append(fmt(col["paper"] / 2**20, 3))
    for method, seq in rows.items():
        assert len(seq) == 6 and contiguous_on_a_line(paper, seq), f"fedhpl_table7 {method}: {seq}"


def test_every_param_table_is_checked(report):
    counts = {n for n, t in report["tables"].items() if t.get("kind") == "param_count"}
    assert counts == set(PARAM_UNITS), f"add the new table(s) to this test: {sorted(counts ^ set(PARAM_UNITS))}"


def test_claims_quote_the_paper(paper, report):
    """Each claim's sentence is the paper's, up to its math (the PDF text garbles symbols such as α or |D_k|):
    every run of plain text between such symbols occurs in the paper."""
    text = re.sub(r"\s+", " ", paper["text"])
    for claim in report["claims"]:
        for part in re.split(r"[^\x20-\x7e]+|\|D_k\|", claim["sentence"]):
            part = part.strip()
            if len(part) >= 12:
                assert part in text, f"claim {claim['id']}: {part!r} is not in the paper"


def test_claim_sources_name_the_papers_sections(paper, report):
    """`source: "§4.2, Table 1"` / "Appendix C.5.5, Table 14": the section heading exists, and the table or figure
    is in that section (between its heading and the next heading of the same depth or above)."""
    lines = paper["lines"]
    heading = re.compile(r"^(?:Appendix )?([A-C]|\d+)(?:\.(\d+))*\s+\S")
    for claim in report["claims"]:
        m = re.match(r"(?:§|Appendix )([A-C0-9.]+), (Table|Fig\.) (\d+)", claim["source"])
        assert m, f"claim {claim['id']}: source {claim['source']!r} is not '§X.Y, Table N' or 'Appendix X.Y, ...'"
        sec, kind, num = m.groups()
        starts = [i for i, line in enumerate(lines) if line.startswith(sec + " ")]
        assert starts, f"claim {claim['id']}: the paper has no section {sec}"
        start = starts[0]
        depth = sec.count(".")
        end = next((j for j in range(start + 1, len(lines)) if heading.match(lines[j])
                    and lines[j].split()[0].count(".") <= depth and not lines[j].startswith(sec + ".")),
                   len(lines))
        body = "\n".join(lines[start:end])
        word = "Table" if kind == "Table" else "Figure"
        assert re.search(rf"{word} {num}\b", body), \
            f"claim {claim['id']}: {word} {num} is not in section {sec} (lines {start + 1}-{end})"
