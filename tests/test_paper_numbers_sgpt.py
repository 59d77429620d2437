"""SGPT's paper numbers in config/reports/sgpt.yaml against the paper's text (shared/papers, CVPR 2024 PDF text).

Catches a transcription typo: every table row's `paper:` numbers must be, in order, the numbers of one line of the
paper's table (citations like "[19]" dropped), the rows in the paper's order after the table's caption; Table 5's
parameter counts must be the "# Parameters" line's "11M ..." values; Fig. 1's points are Table 1's s=10 Global
and Worst Local cells; each figure's `paper:` point occurs in the text; each claim's sentence is quoted verbatim.
Skips when the shared papers folder (beside the repository, as in CI) or the paper's file is absent.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAPER_TEXT = ROOT.parent / "shared" / "papers" / "sgpt_cvpr2024_pdf.txt"
REPORT = ROOT / "config" / "reports" / "sgpt.yaml"
SCALE_FILES = sorted((ROOT / "config" / "scales").glob("*/sgpt.yaml"))

NUMBER = re.compile(r"\d+(?:\.\d+)?")
CITATION = re.compile(r"\[\d+(?:,\s*\d+)*\]")


@pytest.fixture(scope="module")
def lines() -> list[str]:
    if not PAPER_TEXT.parent.is_dir():
        pytest.skip(f"no shared papers folder at {PAPER_TEXT.parent}")
    if not PAPER_TEXT.is_file():
        pytest.skip(f"SGPT's paper text is absent: {PAPER_TEXT}")
    return PAPER_TEXT.read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def report() -> dict:
    return yaml.safe_load(REPORT.read_text(encoding="utf-8"))


def numbers(line: str) -> list[float]:
    return [float(x) for x in NUMBER.findall(CITATION.sub("", line))]


def metrics_tables(report: dict) -> list[str]:
    return [name for name, t in report["tables"].items() if isinstance(t.get("paper"), dict)]


def test_every_metrics_table_is_checked(report):
    assert metrics_tables(report) == ["sgpt_table1", "sgpt_table2", "sgpt_table3", "sgpt_table4"]


@pytest.mark.parametrize("table", ["sgpt_table1", "sgpt_table2", "sgpt_table3", "sgpt_table4"])
def test_table_rows_are_the_papers_lines(lines, report, table):
    number = re.fullmatch(r"sgpt_table(\d+)", table).group(1)
    caption = next((i for i, line in enumerate(lines) if line.startswith(f"Table {number}.")), None)
    assert caption is not None, f"no caption 'Table {number}.' in {PAPER_TEXT.name}"
    at = caption
    for row, values in report["tables"][table]["paper"].items():
        want = [v for v in values if v is not None]
        hit = next((i for i in range(at + 1, min(at + 40, len(lines))) if numbers(lines[i]) == want), None)
        assert hit is not None, (
            f"{table} row {row}: {want} is no line of the paper's Table {number} after line {at + 1} "
            f"(or the rows are out of the paper's order)")
        at = hit


def test_table5_parameter_counts(lines, report):
    row = next(line for line in lines if line.startswith("# Parameters"))
    printed = [round(float(x) * 1e6) for x in re.findall(r"(\d+(?:\.\d+)?)M", row)]
    assert [c["paper"] for c in report["tables"]["sgpt_table5"]["columns"]] == printed


def test_fig1_points_are_table1_s10(report):
    table = report["tables"]["sgpt_table1"]
    labels = [c["label"] for c in table["columns"]]
    g, w = labels.index("C100 Global s=10"), labels.index("C100 Worst s=10")
    for method, (x, y) in report["figures"]["sgpt_fig1"]["paper"].items():
        assert [x, y] == [table["paper"][method][g], table["paper"][method][w]], method


def figure_points(spec: dict):
    for point in spec.get("paper", []) if isinstance(spec.get("paper"), list) else []:
        yield point["y"]
    for series in spec.get("series", []):
        for point in series.get("paper", []):
            yield point["y"]


def test_figure_points_occur_in_text(lines, report):
    printed = {float(x) for line in lines for x in NUMBER.findall(line)}
    sources = [(REPORT.name, report)] + [(str(p.relative_to(ROOT)), yaml.safe_load(p.read_text(encoding="utf-8")))
                                          for p in SCALE_FILES]
    checked = 0
    for source, doc in sources:
        for name, spec in (doc or {}).get("figures", {}).items():
            for y in figure_points(spec):
                assert float(y) in printed, f"{source}: figure {name}'s paper point {y} is not in the paper's text"
                checked += 1
    assert checked >= 4


def normalise(text: str) -> str:
    text = re.sub(r"[*`$]", "", text)
    text = re.sub(r"\s+", " ", text)
    return re.sub(r" ([,.;:])", r"\1", text).strip()


def test_claim_sentences_are_quoted(lines, report):
    # the running text without the tables (tab-separated lines) and their captions, which split sentences
    prose = normalise(" ".join(line for line in lines
                               if "\t" not in line and not re.match(r"(Table|Figure) \d+\.", line)))
    for claim in report["claims"]:
        assert normalise(claim["sentence"]) in prose, f"claim {claim['id']}: sentence not in the paper's text"
    quote = re.search(r'"(.+)"', report["reported_round"]["source"]).group(1)
    assert normalise(quote) in prose
