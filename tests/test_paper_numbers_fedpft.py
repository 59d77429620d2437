"""FedPFT: every paper number in config/reports/fedpft.yaml is printed by the paper's text, in its row.

For each row of each table (and Fig. 5(b)'s inline table) the row's numbers, formatted with the paper's two
decimals (mean, then ± std where `paper_std` gives one), must occur in that order in one line of the paper's
text; Table 10's counts are written as the paper writes them (1.24M, 25.70K). The claims' sentences and the
reported-round quote must occur in the text as well (their plain-word stretches; symbols the text renders as
LaTeX are skipped). A typo in a transcribed cell, or two cells swapped, breaks the order in that row.

The papers' text lives beside the repository (``<repo>/../shared/papers``); the test skips when it is absent.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO.parent / "shared" / "papers" / "fedpft_arxiv2407.16139.txt"
REPORT = REPO / "config" / "reports" / "fedpft.yaml"

# The text prints Table 6's "FedPFT w/o L_Con" Tiny-ImageNet std as "1,32" (a decimal comma); read as 1.32.
DECIMAL_COMMA = re.compile(r"(?<=\d),(?=\d\d\b)")
# Labels ending in digits that the flattened text glues to the first number ("CIFAR-1088.60", "ResNet-81.24M").
GLUED_LABELS = re.compile(r"\b(CIFAR-100|CIFAR-10|ResNet-10|ResNet-8)(?=\d)")
NUMBER = re.compile(r"\d+\.\d{2}[MK]?")


@pytest.fixture(scope="module")
def paper_lines() -> list[list[str]]:
    if not PAPER.is_file():
        pytest.skip(f"paper text not found: {PAPER} (the shared folder beside the repository)")
    out = []
    for line in PAPER.read_text(encoding="utf-8").splitlines():
        line = GLUED_LABELS.sub(r"\1 ", DECIMAL_COMMA.sub(".", line))
        out.append(NUMBER.findall(line))
    return out


@pytest.fixture(scope="module")
def report() -> dict:
    return yaml.safe_load(REPORT.read_text(encoding="utf-8"))


def _in_order(seq: list[str], tokens: list[str]) -> bool:
    it = iter(tokens)
    return all(any(t == s for t in it) for s in seq)


def _row_sequences(report: dict):
    """(table, row, [formatted numbers]) for every table row holding paper numbers."""
    tables = report["tables"]
    for name, tab in tables.items():
        if isinstance(tab.get("paper"), dict):
            stds = tab.get("paper_std") or {}
            for row, vals in tab["paper"].items():
                if all(v is None for v in vals):
                    continue
                seq = []
                for j, v in enumerate(vals):
                    assert v is not None, f"{name}.{row}[{j}]: a partial row"
                    seq.append(f"{v:.2f}")
                    if row in stds:
                        seq.append(f"{stds[row][j]:.2f}")
                yield name, row, seq
        elif tab.get("kind") == "param_count":
            rows: dict[str, list[str]] = {}
            for col in tab["columns"]:
                if col.get("paper") is None:
                    continue
                v = col["paper"]
                rows.setdefault(col["method"], []).append(
                    f"{v / 1e6:.2f}M" if v >= 1e5 else f"{v / 1e3:.2f}K")  # as printed: 0.26M, 65.66K
            for row, seq in rows.items():
                yield name, row, seq


def test_every_table_row_is_in_the_paper(report, paper_lines):
    checked, missing = 0, []
    for name, row, seq in _row_sequences(report):
        checked += len(seq)
        if not any(_in_order(seq, toks) for toks in paper_lines):
            missing.append(f"{name}.{row}: {' '.join(seq)}")
    assert not missing, "rows whose numbers the paper's text does not print in this order:\n" + "\n".join(missing)
    assert checked >= 490, checked   # 486 accuracies and stds + 12 counts (Table 10) at this audit


def _plain_stretches(sentence: str) -> list[str]:
    """Runs of at least three plain words, split at elisions and at symbols the text renders as LaTeX."""
    parts = re.split(r"\[\.\.\.\]|\S*[_^=κρατφ]\S*|[‘’\"]", sentence)
    return [p.strip(" ,.") for p in parts if len(p.split()) >= 3]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_claim_sentences_are_quoted_from_the_paper(report, paper_lines):
    text = _flat(PAPER.read_text(encoding="utf-8"))
    quotes = [c["sentence"] for c in report["claims"]]
    quotes += re.findall(r'"([^"]+)"', report["reported_round"]["source"])
    missing = [s for q in quotes for s in _plain_stretches(_flat(q)) if s not in text]
    assert not missing, "quoted text not found in the paper:\n" + "\n".join(missing)
