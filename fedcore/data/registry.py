"""Public data API called by the Snakemake rules: names, raw files, fetching, building, checking.

Raw files live under ``<resources>/raw/<filename>`` (downloaded) or ``<resources>/manual/<filename>``
(placed by the user), as listed in config/checksums.yaml. Archives are extracted once into
``<resources>/extracted/<dataset>/<archive stem>/`` (reused while the pinned checksum is unchanged).
Embedded datasets and the smoke scale's synthetic analogues (fedcore/data/synthetic.py) need none of this: they
are generated in-process.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path, PurePosixPath
from typing import Iterable

import yaml

from fedcore.data import sources, sources_clip
from fedcore.data.arrays import DatasetBundle, save_bundle
from fedcore.data.download import (ChecksumError, ChecksumNotPinned, DataError, DownloadError, ManualDataMissing,
                                   download, extract, file_digests, verify_file)
from fedcore.data.embedded import EMBEDDED_DATASETS, PUBLIC_DATASETS, build_embedded
from fedcore.data.facts import SYNTHETIC
from fedcore.data.synthetic import build_synthetic
from fedcore.io import atomic_write_text

log = logging.getLogger(__name__)

EMBEDDED: frozenset[str] = frozenset(EMBEDDED_DATASETS) | frozenset(PUBLIC_DATASETS)
CONVERTERS = {**sources.CONVERTERS, **sources_clip.CONVERTERS}
PAPER: tuple[str, ...] = tuple(CONVERTERS) + tuple(sources.COMPOSITES)
DATASETS: tuple[str, ...] = tuple(EMBEDDED_DATASETS) + tuple(PUBLIC_DATASETS) + PAPER + tuple(SYNTHETIC)

RAW_DIR, MANUAL_DIR, EXTRACTED_DIR = "raw", "manual", "extracted"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
_MARKER = ".fedcore_source.json"  # records which verified archive an extracted dir came from
DEFAULT_TIMEOUT = 60.0


class ChecksumsConfigError(ValueError):
    """config/checksums.yaml does not have the expected shape."""


def is_embedded(name: str) -> bool:
    """True for the embedded digits datasets (scale mini)."""
    return name in EMBEDDED


def is_generated(name: str) -> bool:
    """True for the datasets generated in-process, without raw files: the embedded digits and the synthetic
    analogues (scale smoke)."""
    return name in EMBEDDED or name in SYNTHETIC


def _check_name(name: str) -> None:
    if name not in DATASETS:
        raise KeyError(f"unknown dataset '{name}'; known datasets: {', '.join(DATASETS)}")


# ---- checksums config ----------------------------------------------------------------------------
_KEYS = {"dataset", "filename", "url", "manual", "instructions", "md5", "sha256", "size", "note"}
_HEX_DIGITS = {"md5": 32, "sha256": 64}
_HEX = {algo: re.compile(rf"^[0-9a-f]{{{n}}}$") for algo, n in _HEX_DIGITS.items()}


def validate_checksums(data: object, source: str = "checksums") -> dict:
    """Check the shape of a checksums mapping and return it normalised (idempotent)."""
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise ChecksumsConfigError(f"{source}: top level must be a mapping with a 'files' list")
    unknown_top = set(data) - {"files", "version"}
    if unknown_top:
        raise ChecksumsConfigError(f"{source}: unknown top-level key(s) {sorted(unknown_top)}")
    out, seen = [], {}
    for i, e in enumerate(data["files"]):
        where = f"{source}: files[{i}]"
        if not isinstance(e, dict):
            raise ChecksumsConfigError(f"{where} must be a mapping, got {type(e).__name__}")
        where += f" (dataset {e.get('dataset')!r}, filename {e.get('filename')!r})"
        bad = set(e) - _KEYS
        if bad:
            raise ChecksumsConfigError(f"{where}: unknown key(s) {sorted(bad)}; allowed: {sorted(_KEYS)}")
        for key in ("dataset", "filename"):
            if not isinstance(e.get(key), str) or not e[key].strip():
                raise ChecksumsConfigError(f"{where}: key '{key}' must be a non-empty string")
        fn = PurePosixPath(e["filename"])
        if fn.is_absolute() or ".." in fn.parts or "\\" in e["filename"]:
            raise ChecksumsConfigError(f"{where}: key 'filename' must be a relative POSIX path without '..'")
        manual = e.get("manual", False)
        if not isinstance(manual, bool):
            raise ChecksumsConfigError(f"{where}: key 'manual' must be true or false")
        urls = e.get("url")
        urls = [] if urls is None else [urls] if isinstance(urls, str) else urls
        if not isinstance(urls, list) or not all(isinstance(u, str) and re.match(r"^https?://", u) for u in urls):
            raise ChecksumsConfigError(f"{where}: key 'url' must be an http(s) URL or a list of them")
        if manual == bool(urls):
            raise ChecksumsConfigError(f"{where}: give exactly one of 'url' or 'manual: true'")
        instr = e.get("instructions")
        if instr is not None and not isinstance(instr, str):
            raise ChecksumsConfigError(f"{where}: key 'instructions' must be a string")
        if manual and not (instr or "").strip():
            raise ChecksumsConfigError(f"{where}: key 'instructions' is required for a manual file")
        digests = {}
        for algo, pattern in _HEX.items():
            v = e.get(algo)
            if v is not None and (not isinstance(v, str) or not pattern.match(v.lower())):
                raise ChecksumsConfigError(f"{where}: key '{algo}' must be null or {_HEX_DIGITS[algo]} "
                                           f"hex digits, got {v!r}")
            digests[algo] = v.lower() if v else None
        size = e.get("size")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise ChecksumsConfigError(f"{where}: key 'size' must be null or a non-negative integer")
        rel = f"{MANUAL_DIR if manual else RAW_DIR}/{fn.as_posix()}"
        if rel in seen:
            raise ChecksumsConfigError(f"{where}: same file as files[{seen[rel]}] ({rel})")
        seen[rel] = i
        out.append({"dataset": e["dataset"], "filename": fn.as_posix(), "url": list(urls), "manual": manual,
                    "instructions": instr, "md5": digests["md5"], "sha256": digests["sha256"],
                    "size": size, "note": e.get("note")})
    return {"version": data.get("version", 1), "files": out}


def load_checksums(path: str | Path) -> dict:
    """Read and validate config/checksums.yaml; errors name the bad entry and key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"checksums file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ChecksumsConfigError(f"{path}: not valid YAML: {exc}") from exc
    return validate_checksums(data, source=str(path))


def _components(name: str) -> list[str]:
    return sources.COMPOSITES.get(name, [name])


def _entries(name: str, checksums: dict) -> list[dict]:
    _check_name(name)
    if is_generated(name):
        return []
    files = validate_checksums(checksums)["files"]
    out = []
    for comp in _components(name):
        mine = [e for e in files if e["dataset"] == comp]
        if not mine:
            raise ChecksumsConfigError(f"checksums config has no entry for dataset '{comp}'"
                                       + (f" (a component of '{name}')" if comp != name else ""))
        out += mine
    return out


def _rel(entry: dict) -> str:
    return f"{MANUAL_DIR if entry['manual'] else RAW_DIR}/{entry['filename']}"


def raw_files(name: str, checksums: dict) -> list[str]:
    """Paths, relative to the resources dir, of the raw files `name` needs (empty when embedded)."""
    return [_rel(e) for e in _entries(name, checksums)]


# ---- fetching and checking -----------------------------------------------------------------------
def _pins(entry: dict) -> dict:
    return {k: entry[k] for k in ("md5", "sha256") if entry[k]}


def _fetch_entry(entry: dict, resources_dir: Path, timeout: float) -> Path:
    dest = resources_dir / _rel(entry)
    pins = _pins(entry)
    if entry["manual"]:
        if not dest.is_file():
            raise ManualDataMissing(entry["dataset"], dest, entry["instructions"], entry["md5"], entry["sha256"])
    elif dest.is_file() and pins:
        try:
            verify_file(dest, **pins)
            return dest  # already verified: never downloaded twice
        except ChecksumError as exc:
            log.warning("%s; downloading it again", exc)
            dest.unlink()
    if not dest.is_file():
        errors: list[Exception] = []
        for url in entry["url"]:
            try:
                download(url, dest, timeout=timeout, **pins)
                break
            except (DownloadError, ChecksumError) as exc:
                errors.append(exc)
        else:
            bad = [e for e in errors if isinstance(e, ChecksumError)]
            if bad:
                raise bad[0]
            raise DownloadError(f"dataset '{entry['dataset']}': every URL for {entry['filename']} failed:\n  "
                                + "\n  ".join(map(str, errors)))
    if not pins:
        # Honest failure: we report the digest so the user can pin it, but never use the file unpinned.
        raise ChecksumNotPinned(entry["dataset"], dest, entry["filename"], file_digests(dest, ("sha256",))["sha256"])
    if entry["manual"]:
        verify_file(dest, **pins)
    return dest


def fetch_raw(name: str, resources_dir: str | Path, checksums: dict, timeout: float = DEFAULT_TIMEOUT) -> list[Path]:
    """Download (or find, for manual files) and verify every raw file of `name`; idempotent."""
    resources_dir = Path(resources_dir)
    return [_fetch_entry(e, resources_dir, timeout) for e in _entries(name, checksums)]


def check_data(names: Iterable[str], resources_dir: str | Path, checksums: dict) -> list[str]:
    """Problems (missing files, bad or unpinned checksums) for the given datasets; empty when all good."""
    resources_dir = Path(resources_dir)
    problems: list[str] = []
    for name in names:
        try:
            entries = _entries(name, checksums)
        except (KeyError, ChecksumsConfigError) as exc:
            problems.append(str(exc).strip("\"'"))
            continue
        for e in entries:
            path = resources_dir / _rel(e)
            head = f"dataset '{e['dataset']}': {path}"
            if not path.is_file():
                how = (f"place it by hand: {e['instructions']}" if e["manual"]
                       else f"download with fetch_raw / the download rule from {' or '.join(e['url'])}")
                problems.append(f"{head} is missing; {how}")
            elif not _pins(e):
                sha = file_digests(path, ("sha256",))["sha256"]
                problems.append(f"{head} has no pinned checksum in config/checksums.yaml "
                                f"(its sha256 is {sha}; pin it after checking the file)")
            else:
                try:
                    verify_file(path, **_pins(e))
                except ChecksumError as exc:
                    problems.append(f"{head}: {exc}")
    return list(dict.fromkeys(problems))  # a composite repeats its components' problems


# ---- building ------------------------------------------------------------------------------------
def _archive_stem(path: Path) -> str | None:
    for suffix in ARCHIVE_SUFFIXES:
        if path.name.lower().endswith(suffix):
            return path.name[: -len(suffix)]
    return None


def _prepare(entry: dict, path: Path, resources_dir: Path) -> Path:
    """The path a converter reads: the file itself, or its (cached) extraction for an archive."""
    stem = _archive_stem(path)
    if stem is None:
        return path
    dest = resources_dir / EXTRACTED_DIR / entry["dataset"] / stem
    marker = {"archive": _rel(entry), **_pins(entry)}
    try:
        if json.loads((dest / _MARKER).read_text()) == marker:
            return dest
    except (OSError, ValueError):
        pass  # absent, partial or stale: extract again
    extract(path, dest)
    atomic_write_text(dest / _MARKER, json.dumps(marker, sort_keys=True))
    return dest


def _convert(name: str, resources_dir: Path, checksums: dict, timeout: float) -> DatasetBundle:
    entries = _entries(name, checksums)
    paths = fetch_raw(name, resources_dir, checksums, timeout=timeout)  # verifies before anything is read
    inputs: dict[str, list[Path]] = {}
    for e, p in zip(entries, paths):
        inputs.setdefault(e["dataset"], []).append(_prepare(e, p, resources_dir))
    if name in sources.COMPOSITES:
        bundle = sources.five_dataset({c: CONVERTERS[c](inputs[c]) for c in sources.COMPOSITES[name]})
    else:
        bundle = CONVERTERS[name](inputs[name])
    bundle.meta["raw_files"] = [{"path": _rel(e), **_pins(e)} for e in entries]
    return bundle


def build_dataset(name: str, out_path: str | Path, resources_dir: str | Path | None = None,
                  checksums: dict | None = None, timeout: float = DEFAULT_TIMEOUT,
                  allow_folder_layout: bool = False) -> None:
    """Write the bundle for `name` to `out_path` atomically (embedded, synthetic: generated; paper: converted).

    Office/DomainNet found as image folders instead of the FedBN pickles get our own train/test split, not the
    papers': refused unless ``allow_folder_layout`` (config key ``allow_folder_layout``)."""
    _check_name(name)
    if is_embedded(name):
        bundle = build_embedded(name)
    elif name in SYNTHETIC:
        bundle = build_synthetic(name)
    else:
        if resources_dir is None or checksums is None:
            raise ValueError(f"dataset '{name}' is built from raw files: resources_dir and checksums are required")
        bundle = _convert(name, Path(resources_dir), checksums, timeout)
        if bundle.meta.get("folder_layout") and not allow_folder_layout:
            raise DataError(f"dataset '{name}': found image folders, not the FedBN pickles "
                            f"(<domain>_train.pkl / <domain>_test.pkl) under {resources_dir}; the folders get our "
                            "own stratified 80/20 split, so the train and test sets differ from the papers'. Put the "
                            "pickles there, or accept our split with `--config allow_folder_layout=true` (the bundle's "
                            "source line then records the layout)")
        if bundle.meta.get("folder_layout"):
            log.warning("dataset %s: built from image folders with our own train/test split (allow_folder_layout)",
                        name)
    bundle.meta.setdefault("name", name)
    save_bundle(bundle, out_path)


__all__ = [
    "EMBEDDED", "PAPER", "DATASETS", "is_embedded", "is_generated", "raw_files", "fetch_raw", "build_dataset", "check_data",
    "load_checksums", "validate_checksums", "ChecksumsConfigError", "ChecksumError", "ChecksumNotPinned",
    "ManualDataMissing", "DownloadError", "DataError",
]
