"""The official code each ``tests/test_official_*.py`` check reads: repository, pinned commit, the folders it needs,
and how to make the checkouts those checks import (``scripts/official_checks.sh`` runs them all).

The commits are the ones the checks were written and last passed against; a checkout is a ``git archive`` of that
commit (only the listed folders where the rest of the archive cannot be had or is not needed), so the checks see
exactly that code, and nothing of it enters this repository.

    python -m fedcore.official_checkouts --into /tmp/official [--mirror DIR]   # prints `export VAR=...` lines
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class OfficialRepo:
    """One official code base: the variable its checks read, where it lives, the commit and folders they need."""

    env: str
    github: str                     # owner/name
    commit: str                     # full hash
    paths: tuple[str, ...] = ()     # folders to extract; () = the whole tree
    checks: tuple[str, ...] = ()    # the test files that read it

    @property
    def url(self) -> str:
        """The public clone URL."""
        return f"https://github.com/{self.github}.git"


OFFICIAL_REPOS: tuple[OfficialRepo, ...] = (
    OfficialRepo("FEDPROMPT_SGPT_OFFICIAL", "ubc-tea/SGPT", "213c95b5435b6ad139f4ee2f6e09fa65c7c0689e",
                 checks=("test_official_sgpt.py", "test_official_partitions.py", "test_official_data.py")),
    OfficialRepo("FEDPROMPT_FEDOTP_OFFICIAL", "HongxiaLee/FedOTP", "9948611a2325adc5543e9185cf0aa92ff84a2936",
                 checks=("test_official_fedotp.py", "test_official_fedotp_baselines.py",
                         "test_official_partitions.py", "test_official_data.py")),
    # PFLlib's and HtFLlib's whole archives reference data blobs that are not always at hand; the code suffices
    OfficialRepo("FEDPROMPT_PFLLIB", "TsingZ0/PFLlib", "d832e76f6a23b833038949ec1e4fdefe63a4d350",
                 paths=("system/flcore", "system/utils"), checks=("test_official_pfllib.py",)),
    OfficialRepo("FEDPROMPT_HTFLLIB", "TsingZ0/HtFLlib", "e959261d906f40377410bc4d9d13ba3f6af56782",
                 paths=("system/flcore", "system/utils"), checks=("test_official_htfllib.py",)),
    OfficialRepo("FEDPROMPT_FEDPR_OFFICIAL", "chunmeifeng/FedPR", "f5c3e67dcc4f23148260c208c15f1aba85a18b60",
                 checks=("test_official_fedpr.py",)),
    OfficialRepo("FEDPROMPT_PFEDPT_OFFICIAL", "hkgdifyu/pFedPT", "cebec63e650522e463f5f9d2e08eb39f2a58c6d2",
                 checks=("test_official_pfedpt.py",)),
    OfficialRepo("FEDPROMPT_FEDEM_OFFICIAL", "omarfoq/FedEM", "996faddf865fd03c6852b7ffe64410e31b339e94",
                 checks=("test_official_fedem.py",)),
    OfficialRepo("FEDPROMPT_PFEDGATE_OFFICIAL", "yxdyc/pFedGate", "b8cfa156acdb08207d33641a355959503ca1db78",
                 checks=("test_official_pfedgate.py",)),
    OfficialRepo("FEDPROMPT_FLING_OFFICIAL", "FLAIR-Community/Fling", "faebd06575adc9531d79fea60321777bad6d5f65",
                 checks=("test_official_fling.py", "test_official_partitions.py", "test_official_data.py")),
    OfficialRepo("FEDPROMPT_VPT_OFFICIAL", "KMnP/vpt", "4410440ec1b489f24f66b9fad3d9b10ff3443567",
                 checks=("test_official_vpt.py",)),
    OfficialRepo("FEDPROMPT_FEDBN_OFFICIAL", "med-air/FedBN", "2fa38adf627a8c8ba71c5fb515b1f2ba00aa8812",
                 checks=("test_official_fedbn.py",)),
    OfficialRepo("FEDPROMPT_FEDPROTO_OFFICIAL", "yuetan031/FedProto", "97e42e2741e1ae2e2fce2465e80f38f6997f8836",
                 checks=("test_official_fedproto.py",)),
    OfficialRepo("FEDPROMPT_FEDBABU_OFFICIAL", "jhoon-oh/FedBABU", "e34c15b4288224f0af1bc13670bc0cdc373c9576",
                 checks=("test_official_fedbabu.py",)),
    OfficialRepo("FEDPROMPT_FEDREP_OFFICIAL", "lgcollins/FedRep", "d82e62982e107bb3322541604f059c0ff28bd289",
                 checks=("test_official_fedrep.py",)),
    OfficialRepo("FEDPROMPT_FEDGEN_OFFICIAL", "zhuangdizhu/FedGen", "dd5807c5625404e99035d97e2ef8c712c2e007a6",
                 checks=("test_official_fedgen.py",)),
    OfficialRepo("FEDPROMPT_FEDGH_OFFICIAL", "LipingYi/FedGH", "ff50ac0caaf96e80e16334ba250be6168765d7a1",
                 checks=("test_official_fedgh.py",)),
    OfficialRepo("FEDPROMPT_PFEDSD_OFFICIAL", "CGCL-codes/pFedSD", "8eba09648e2ce9fd1298101bd8d21c0df248dca9",
                 checks=("test_official_pfedsd.py",)),
)


def _git(*args: str) -> subprocess.CompletedProcess:
    """Run git, raising with its own message on failure."""
    done = subprocess.run(["git", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def source_repo(repo: OfficialRepo, mirror: Path | None, cache: Path) -> Path:
    """A git directory holding ``repo.commit``: ``mirror/<owner>+<name>/repo`` or ``mirror/<owner>/<name>`` if
    given, else a clone into ``cache`` (needs the internet)."""
    if mirror is not None:
        owner, name = repo.github.split("/")
        for cand in (mirror / f"{owner}+{name}" / "repo", mirror / owner / name, mirror / name):
            if cand.is_dir():
                return cand
        raise FileNotFoundError(f"{repo.github}: no clone under {mirror} (looked for {owner}+{name}/repo, "
                                f"{owner}/{name}, {name})")
    dest = cache / repo.github.replace("/", "+")
    if not dest.is_dir():
        _git("clone", "--quiet", "--bare", repo.url, str(dest))
    return dest


def make_checkout(repo: OfficialRepo, source: Path, dest: Path) -> Path:
    """Extract ``repo.commit`` (its ``paths``, or the whole tree) from the git directory ``source`` into ``dest``,
    replacing what was there only once the extraction has succeeded."""
    try:
        _git("-C", str(source), "cat-file", "-e", f"{repo.commit}^{{commit}}")
    except RuntimeError:
        raise RuntimeError(f"{repo.github}: {source} does not hold the pinned commit {repo.commit[:7]} "
                           f"(fetch it, or use a clone that has it)") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        archive = subprocess.run(["git", "-C", str(source), "archive", "--format=tar", repo.commit, *repo.paths],
                                 capture_output=True)
        if archive.returncode != 0:
            raise RuntimeError(f"{repo.github}: git archive {repo.commit[:7]} {' '.join(repo.paths)}: "
                               f"{archive.stderr.decode(errors='replace').strip()}")
        subprocess.run(["tar", "-x", "-C", str(part)], input=archive.stdout, check=True)
        if dest.exists():
            shutil.rmtree(dest)
        part.rename(dest)
    finally:
        if part.exists():
            shutil.rmtree(part)
    return dest


def make_checkouts(into: Path, mirror: Path | None = None) -> dict[str, Path]:
    """Every official checkout under ``into`` (one folder per repository): environment variable -> path."""
    into.mkdir(parents=True, exist_ok=True)
    env = {}
    for repo in OFFICIAL_REPOS:
        source = source_repo(repo, mirror, into / ".git-cache")
        env[repo.env] = make_checkout(repo, source, into / repo.github.replace("/", "+"))
    return env


def main(argv: list[str] | None = None) -> int:
    """Make the checkouts and print one ``export VAR=path`` line per repository (for ``eval``)."""
    ap = argparse.ArgumentParser(description="Make checkouts of the official code at the pinned commits.")
    ap.add_argument("--into", type=Path, required=True, help="folder for the checkouts (made if missing)")
    ap.add_argument("--mirror", type=Path, help="a folder of local clones (<owner>+<name>/repo or <owner>/<name>) "
                    "to use instead of cloning from GitHub")
    args = ap.parse_args(argv)
    try:
        env = make_checkouts(args.into.resolve(), args.mirror.resolve() if args.mirror else None)
    except (RuntimeError, FileNotFoundError, subprocess.CalledProcessError) as err:
        print(f"official_checkouts: {err}", file=sys.stderr)
        return 1
    for var, path in env.items():
        print(f"export {var}={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
