"""Download, checksum and extraction machinery for the paper-scale datasets.

Every raw file is verified against a checksum pinned in config/checksums.yaml before it is used;
nothing unverified is ever accepted silently. Downloads and extractions go to a temporary path
beside their destination and are renamed into place only once complete and verified, so an
interrupted or corrupted transfer never leaves a partial file or directory behind.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath

_CHUNK = 1 << 20  # 1 MiB: streaming keeps memory flat for multi-GB archives
USER_AGENT = "fedcore-data/0.1 (+urllib)"


class DataError(Exception):
    """Base class for every data-acquisition error raised by fedcore."""


class ChecksumError(DataError):
    """A file's digest differs from the one pinned in config/checksums.yaml."""

    def __init__(self, path: str | os.PathLike, expected: dict[str, str], actual: dict[str, str],
                 url: str | None = None) -> None:
        self.path, self.url, self.expected, self.actual = Path(path), url, expected, actual
        exp = ", ".join(f"{k}={v}" for k, v in expected.items())
        act = ", ".join(f"{k}={actual[k]}" for k in expected)
        src = f" downloaded from {url}" if url else ""
        super().__init__(f"checksum mismatch for {self.path}{src}: expected {exp}, got {act}. "
                         "The file was not accepted (a corrupted transfer, a changed upstream file "
                         "or a wrong pin in config/checksums.yaml).")


class ManualDataMissing(DataError):
    """A file that must be fetched by hand is not where the pipeline expects it."""

    def __init__(self, dataset: str, path: str | os.PathLike, instructions: str,
                 md5: str | None = None, sha256: str | None = None) -> None:
        self.dataset, self.path = dataset, Path(path)
        pins = ", ".join(f"{k}={v}" for k, v in (("sha256", sha256), ("md5", md5)) if v)
        pins = pins or "none pinned yet (fedcore will print the file's sha256 for you to pin)"
        super().__init__(f"dataset '{dataset}' needs a file you must download yourself.\n"
                         f"  put it exactly here: {self.path}\n"
                         f"  where to get it:     {instructions}\n"
                         f"  expected checksum:   {pins}")


class ChecksumNotPinned(DataError):
    """A raw file exists but config/checksums.yaml records no checksum for it."""

    def __init__(self, dataset: str, path: str | os.PathLike, filename: str, sha256: str) -> None:
        self.dataset, self.path, self.sha256 = dataset, Path(path), sha256
        super().__init__(f"dataset '{dataset}': {self.path} is present but config/checksums.yaml pins no "
                         f"checksum for '{filename}', and fedcore never uses unverified data.\n"
                         f"  its sha256 is {sha256}\n"
                         f"  after checking the file against a trusted source, pin it with "
                         f"`sha256: {sha256}` in that entry of config/checksums.yaml")


class DownloadError(DataError):
    """Every URL of a raw file failed to download."""


def file_digests(path: str | os.PathLike, algorithms: tuple[str, ...] = ("md5", "sha256")) -> dict[str, str]:
    """Hex digests of a file for the given hashlib algorithms, in one streaming pass."""
    hashers = {a: hashlib.new(a) for a in algorithms}
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            for h in hashers.values():
                h.update(chunk)
    return {a: h.hexdigest() for a, h in hashers.items()}


def _expected(md5: str | None, sha256: str | None) -> dict[str, str]:
    exp = {k: v.lower() for k, v in (("md5", md5), ("sha256", sha256)) if v}
    if not exp:
        raise ValueError("no checksum given: pass md5 and/or sha256")
    return exp


def verify_file(path: str | os.PathLike, md5: str | None = None, sha256: str | None = None) -> None:
    """Raise ChecksumError unless the file matches every given digest (FileNotFoundError if absent)."""
    path = Path(path)
    expected = _expected(md5, sha256)
    if not path.is_file():
        raise FileNotFoundError(f"cannot verify {path}: no such file")
    actual = file_digests(path, tuple(expected))
    if any(actual[k] != v for k, v in expected.items()):
        raise ChecksumError(path, expected, actual)


def download(url: str, dest: str | os.PathLike, md5: str | None = None, sha256: str | None = None,
             timeout: float = 60.0) -> Path:
    """Stream `url` to `dest` through a temp file beside it; verify, then rename atomically.

    With no checksum the file is still written (so its digest can be reported and pinned), but the
    caller is responsible for refusing it; registry.fetch_raw does exactly that.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    expected = {k: v.lower() for k, v in (("md5", md5), ("sha256", sha256)) if v}
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        hashers = {a: hashlib.new(a) for a in ("md5", "sha256")}
        request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(request, timeout=timeout) as resp:
            while chunk := resp.read(_CHUNK):
                out.write(chunk)
                for h in hashers.values():
                    h.update(chunk)
        actual = {a: h.hexdigest() for a, h in hashers.items()}
        if any(actual[k] != v for k, v in expected.items()):
            raise ChecksumError(dest, expected, actual, url=url)
        os.replace(tmp, dest)
    except (urllib.error.URLError, OSError) as exc:  # HTTPError is a URLError; timeouts are OSErrors
        raise DownloadError(f"could not download {url} to {dest}: {exc}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return dest


def _archive_kind(archive: Path) -> str:
    if zipfile.is_zipfile(archive):
        return "zip"
    if tarfile.is_tarfile(archive):
        return "tar"
    raise ValueError(f"{archive} is neither a zip nor a tar archive")


def _check_member(name: str, archive: Path) -> None:
    # Reject absolute paths and '..' so an archive cannot write outside its destination.
    p = PurePosixPath(name.replace("\\", "/"))
    if p.is_absolute() or ".." in p.parts or (p.parts and ":" in p.parts[0]):
        raise ValueError(f"refusing to extract {archive}: member '{name}' would escape the destination")


def extract(archive: str | os.PathLike, dest_dir: str | os.PathLike) -> Path:
    """Extract a tar(.gz) or zip archive into `dest_dir` atomically, refusing path traversal.

    The archive is unpacked into a temp dir beside `dest_dir` and renamed into place only on
    success; an existing `dest_dir` is replaced. On any error nothing is left behind.
    """
    archive, dest_dir = Path(archive), Path(dest_dir)
    kind = _archive_kind(archive)
    dest_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest_dir.name}.", suffix=".extracting", dir=dest_dir.parent))
    old: Path | None = None
    try:
        if kind == "zip":
            with zipfile.ZipFile(archive) as zf:
                for name in zf.namelist():
                    _check_member(name, archive)
                zf.extractall(tmp)
        else:
            with tarfile.open(archive) as tf:
                for m in tf.getmembers():
                    _check_member(m.name, archive)
                    if not (m.isfile() or m.isdir()):
                        # Links and device files are never part of an image dataset; refusing them
                        # closes the symlink-escape route entirely.
                        raise ValueError(f"refusing to extract {archive}: member '{m.name}' is not a regular file")
                tf.extractall(tmp, filter="data")
        if dest_dir.exists():
            old = dest_dir.with_name(f".{dest_dir.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(dest_dir, old)
        os.replace(tmp, dest_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists():
            shutil.rmtree(old, ignore_errors=True)
    return dest_dir
