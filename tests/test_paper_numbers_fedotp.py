"""FedOTP's paper numbers in config/reports/fedotp.yaml are the supplement's, cell by cell.

Each table (A1 to A5) is found in the supplement's text by its caption; its rows are read in order (Table A4's
dataset cell is blank on its 2- to 16-shot rows) and compared, number by number, with the report's `paper:` (and
`paper_std:`, the "±" part) of the row that the paper's row label names. The `_bugs` rows must repeat their plain
row's numbers. Each claim's `sentence` must be quoted verbatim. The supplement lies in the shared folder beside
the repository (`../shared/papers`); without it the module is skipped.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT.parent / "shared" / "papers" / "fedotp_cvpr2024_supplement.txt"
if not PAPER.is_file():
    pytest.skip(f"the FedOTP supplement's text is not here ({PAPER})", allow_module_level=True)

TEXT = PAPER.read_text(encoding="utf-8")
REPORT = yaml.safe_load((ROOT / "config" / "reports" / "fedotp.yaml").read_text())
TABLES = REPORT["tables"]

# the paper's row labels (citation stripped) -> the report's row keys
METHODS = {"Zero-Shot CLIP": "zs_clip", "CoOp": "coop", "PromptFL": "promptfl",
           "PromptFL+FedProx": "promptfl_fedprox", "FedOTP (Ours)": "fedotp",
           "FedOTP (Similarity Averaging)": "fedotp_simavg", "FedOTP (Classical OT)": "fedotp_cot",
           "FedOTP (Unbalanced OT)": "fedotp"}
A4_DATASETS = {"DTD": "dtd", "Caltech101": "caltech101", "Flowers102": "flowers102", "OxfordPets": "oxford_pets"}


def paper_rows(caption: str) -> list[list[str]]:
    """The cells of each row of the table whose caption starts with ``caption`` (the first table after it)."""
    lines = TEXT.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(caption))
    rows, inside = [], False
    for line in lines[start + 1:]:
        if line.startswith("|"):
            inside = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):          # not the header's rule
                rows.append(cells)
        elif inside:
            break
    return rows


def numbers(cell: str) -> tuple[float, float | None]:
    """A cell's mean and its "±" part (None without one); thousands commas dropped."""
    mean, _, std = cell.replace(",", "").partition("±")
    return float(mean), (float(std) if std else None)


def method_rows(caption: str) -> dict[str, list[str]]:
    out = {}
    for cells in paper_rows(caption):
        label = re.sub(r"\s*\[\d+\]$", "", cells[0])
        if label in METHODS:
            out[METHODS[label]] = cells[1:]
    return out


def check(table: str, key: str, cells: list[str]) -> None:
    spec = TABLES[table]
    means, stds = zip(*(numbers(c) for c in cells))
    assert list(spec["paper"][key]) == list(means), f"{table} row {key}: paper {means}"
    if any(s is not None for s in stds):
        assert list(spec["paper_std"][key]) == list(stds), f"{table} row {key} (±): paper {stds}"


def test_table_a1():
    header, *body = paper_rows("Table A1.")
    assert header == ["Dataset", "Task", "Classes", "Training Size", "Testing Size", "Domains"]
    rows = {re.sub(r"\s*\[\d+\]$", "", c[0]): c for c in body}
    spec = TABLES["fedotp_table_a1"]["rows"]
    assert len(spec) == len(rows)
    for row in spec:
        cells = rows[row["label"]]
        assert row["task"] == cells[1]
        got = {k: numbers(cells[j])[0] for k, j in (("classes", 2), ("train", 3), ("test", 4), ("domains", 5))}
        assert row["paper"] == got, f"Table A1 {row['label']}: paper {got}"


@pytest.mark.parametrize("table, caption", [("fedotp_table_a2", "Table A2."), ("fedotp_table_a3", "Table A3."),
                                            ("fedotp_table_a5", "Table A5.")])
def test_method_tables(table, caption):
    rows = method_rows(caption)
    assert set(rows) == {k for k in TABLES[table]["paper"] if not k.endswith("_bugs")}
    for key, cells in rows.items():
        assert len(cells) == len(TABLES[table]["columns"])
        check(table, key, cells)


def test_table_a4():
    rows, dataset = paper_rows("Table A4."), None
    header, body = rows[0], rows[1:]
    assert header[2:] == ["1", "0.9", "0.8", "0.7", "0.6", "0.5"]
    assert [c["label"] for c in TABLES["fedotp_table_a4"]["columns"]] == [f"gamma={g}" for g in header[2:]]
    keys = []
    for cells in body:
        dataset = A4_DATASETS[cells[0]] if cells[0] else dataset
        keys.append(f"{dataset}_s{cells[1].split()[0]}")
        check("fedotp_table_a4", keys[-1], cells[2:])
    assert keys == TABLES["fedotp_table_a4"]["rows"]


@pytest.mark.parametrize("table", ["fedotp_table_a2", "fedotp_table_a3"])
def test_bug_rows_repeat_the_paper_rows(table):
    for part in ("paper", "paper_std"):
        values = TABLES[table].get(part, {})
        for key, row in values.items():
            if key.endswith("_bugs"):
                assert row == values[key[:-len("_bugs")]], f"{table} {part} {key}"


def test_claims_quote_the_supplement():
    flat = " ".join(TEXT.split())
    for claim in REPORT["claims"]:
        assert " ".join(claim["sentence"].split()) in flat, claim["id"]
