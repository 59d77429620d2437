"""The papers this pipeline reproduces: one registry, read by the config (the schema's allowed ``papers``, filled in
at load time), by the report (each paper's section title) and by the rules.

A paper named here has its experiments in config/experiments/<paper>.yaml and its tables, figures and claims in
config/reports/<paper>.yaml.
"""
from __future__ import annotations

#: paper name (the config's and the files') -> its title in the report
PAPERS: dict[str, str] = {"sgpt": "SGPT", "fedhpl": "FedHPL", "fedotp": "FedOTP", "fedpft": "FedPFT"}


def paper_title(paper: str) -> str:
    """The display name of a paper (its report category); the name itself for one the registry does not know."""
    return PAPERS.get(paper, paper)
