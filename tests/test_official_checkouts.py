"""The pinned official code base behind every tests/test_official_*.py check, and how its checkout is made."""
from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from fedcore.official_checkouts import OFFICIAL_REPOS, OfficialRepo, main, make_checkout, source_repo

TESTS = Path(__file__).parent
OWN = {"FEDPROMPT_VERBOSE"}  # the checks' own switches, not checkouts


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo_two_commits(tmp_path: Path) -> tuple[Path, str, str]:
    """A local repository whose first commit has code/ and data/, the second changes code/a.py."""
    src = tmp_path / "owner+name" / "repo"
    (src / "code").mkdir(parents=True)
    (src / "data").mkdir()
    (src / "code" / "a.py").write_text("X = 1\n")
    (src / "data" / "big.bin").write_text("blob\n")
    _git(src, "init", "-q")
    _git(src, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(src, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    first = _git(src, "rev-parse", "HEAD")
    (src / "code" / "a.py").write_text("X = 2\n")
    _git(src, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    return src, first, _git(src, "rev-parse", "HEAD")


def test_every_check_reads_only_listed_checkouts_and_every_listed_check_exists():
    """A new tests/test_official_*.py must name its repository here (so scripts/official_checks.sh makes it)."""
    listed = {r.env for r in OFFICIAL_REPOS}
    files = sorted(TESTS.glob("test_official_*.py"))
    files.remove(Path(__file__))
    assert files
    for f in files:
        used = set(re.findall(r"FEDPROMPT_[A-Z0-9_]+", f.read_text())) - OWN
        assert used, f"{f.name} reads no checkout variable"
        assert used <= listed, f"{f.name} reads {sorted(used - listed)}, not in OFFICIAL_REPOS"
        assert any(f.name in r.checks for r in OFFICIAL_REPOS), f"{f.name} is in no OfficialRepo.checks"
    for r in OFFICIAL_REPOS:
        assert re.fullmatch(r"[0-9a-f]{40}", r.commit), r
        for check in r.checks:
            assert r.env in (TESTS / check).read_text(), f"{check} does not read {r.env}"


def test_checkout_is_the_pinned_commit_and_only_its_folders(repo_two_commits, tmp_path):
    src, first, _ = repo_two_commits
    repo = OfficialRepo("FEDPROMPT_X", "owner/name", first, paths=("code",))
    dest = make_checkout(repo, src, tmp_path / "out" / "owner+name")
    assert (dest / "code" / "a.py").read_text() == "X = 1\n"      # the pinned commit, not HEAD
    assert not (dest / "data").exists()
    whole = make_checkout(replace(repo, paths=()), src, dest)      # replaces the earlier checkout
    assert (whole / "data" / "big.bin").is_file()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["owner+name"]   # no partial folders left


def test_a_missing_commit_or_clone_is_named_and_the_old_checkout_kept(repo_two_commits, tmp_path):
    src, first, _ = repo_two_commits
    dest = make_checkout(OfficialRepo("FEDPROMPT_X", "owner/name", first), src, tmp_path / "co")
    with pytest.raises(RuntimeError, match=r"owner/name: .* does not hold the pinned commit 0000000"):
        make_checkout(OfficialRepo("FEDPROMPT_X", "owner/name", "0" * 40), src, dest)
    with pytest.raises(RuntimeError, match="git archive"):
        make_checkout(OfficialRepo("FEDPROMPT_X", "owner/name", first, paths=("nowhere",)), src, dest)
    assert (dest / "code" / "a.py").read_text() == "X = 1\n"
    with pytest.raises(FileNotFoundError, match=r"other/repo: no clone under"):
        source_repo(OfficialRepo("FEDPROMPT_X", "other/repo", first), tmp_path, tmp_path / "cache")
    assert source_repo(OfficialRepo("FEDPROMPT_X", "owner/name", first), src.parent.parent, tmp_path) == src


def test_command_line_prints_one_export_per_repository(repo_two_commits, tmp_path, monkeypatch, capsys):
    src, first, _ = repo_two_commits
    import fedcore.official_checkouts as oc
    monkeypatch.setattr(oc, "OFFICIAL_REPOS", (OfficialRepo("FEDPROMPT_X", "owner/name", first),))
    assert main(["--into", str(tmp_path / "into"), "--mirror", str(src.parent.parent)]) == 0
    assert capsys.readouterr().out == f"export FEDPROMPT_X={tmp_path / 'into' / 'owner+name'}\n"
    assert main(["--into", str(tmp_path / "into"), "--mirror", str(tmp_path / "none")]) == 1
    assert "owner/name: no clone under" in capsys.readouterr().err
