"""The real download -> verify -> extract -> convert path, against a local HTTP server."""
from __future__ import annotations

import ast
import hashlib
import http.server
import importlib.util
import io
import pickle
import tarfile
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedcore.data import download as dl
from fedcore.data.arrays import load_bundle
from fedcore.data.download import ChecksumError, ChecksumNotPinned, DataError, ManualDataMissing
from fedcore.data.registry import (ChecksumsConfigError, DATASETS, PAPER, build_dataset, check_data, fetch_raw,
                                   load_checksums, raw_files, validate_checksums)

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PER_CLASS = 2  # images per class per batch: 5 train batches -> 100 train, 20 test
ARCHIVE = "cifar-10-python.tar.gz"


def _batch(rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    labels = [c for c in range(10) for _ in range(PER_CLASS)]
    data = rng.integers(0, 256, size=(len(labels), 3 * 32 * 32), dtype=np.uint8)
    return data, labels


def _cifar10_archive() -> tuple[bytes, dict]:
    """A CIFAR-10-format tar.gz (python pickles, bytes keys as in the original) and its arrays."""
    rng = np.random.default_rng(0)
    members, train_x, train_y = {}, [], []
    for i in range(1, 6):
        data, labels = _batch(rng)
        members[f"data_batch_{i}"] = {b"batch_label": b"training batch", b"data": data, b"labels": labels}
        train_x.append(data)
        train_y += labels
    test_x, test_y = _batch(rng)
    members["test_batch"] = {b"batch_label": b"testing batch", b"data": test_x, b"labels": test_y}
    members["batches.meta"] = {b"label_names": [c.encode() for c in CLASSES], b"num_vis": 3072}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, obj in members.items():
            raw = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(raw)
            tf.addfile(info, io.BytesIO(raw))
    to_img = lambda flat: flat.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    expected = {"train_x": to_img(np.concatenate(train_x)), "train_y": np.asarray(train_y),
                "test_x": to_img(test_x), "test_y": np.asarray(test_y)}
    return buf.getvalue(), expected


@pytest.fixture()
def server(tmp_path):
    """Serve tmp_path/www on 127.0.0.1 (ephemeral port); yields (base url, www dir, request log)."""
    www = tmp_path / "www"
    www.mkdir()
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(www), **kw)

        def do_GET(self):  # noqa: N802 (http.server naming)
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args):  # keep test output clean
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", www, requests
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="module")
def archive():
    return _cifar10_archive()


def _checksums(url: str, data: bytes) -> dict:
    return {"files": [{"dataset": "cifar10", "filename": f"cifar10/{ARCHIVE}", "url": url,
                       "md5": hashlib.md5(data).hexdigest(), "sha256": hashlib.sha256(data).hexdigest()}]}


def _all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_fetch_and_build_cifar10(tmp_path, server, archive):
    base, www, requests = server
    data, expected = archive
    (www / ARCHIVE).write_bytes(data)
    res, out = tmp_path / "resources", tmp_path / "data" / "cifar10.npz"
    checksums = _checksums(f"{base}/{ARCHIVE}", data)

    assert raw_files("cifar10", checksums) == [f"raw/cifar10/{ARCHIVE}"]
    assert check_data(["cifar10"], res, checksums)[0].endswith(f"from {base}/{ARCHIVE}")
    paths = fetch_raw("cifar10", res, checksums)
    assert paths == [res / "raw" / "cifar10" / ARCHIVE] and paths[0].read_bytes() == data
    assert fetch_raw("cifar10", res, checksums) == paths and len(requests) == 1  # verified: not fetched again
    assert check_data(["cifar10"], res, checksums) == []

    build_dataset("cifar10", out, res, checksums)
    b = load_bundle(out)
    assert b.meta["classes"] == CLASSES and b.pretrain is None
    assert np.array_equal(b.train.x, expected["train_x"]) and np.array_equal(b.train.y, expected["train_y"])
    assert np.array_equal(b.test.x, expected["test_x"]) and np.array_equal(b.test.y, expected["test_y"])
    assert b.meta["raw_files"][0]["sha256"] == hashlib.sha256(data).hexdigest()
    assert len(requests) == 1
    # a rebuild reuses the verified download and the cached extraction
    build_dataset("cifar10", out, res, checksums)
    assert len(requests) == 1 and np.array_equal(load_bundle(out).train.x, expected["train_x"])


def test_corrupted_download_leaves_nothing_behind(tmp_path, server, archive):
    base, www, _ = server
    data, _ = archive
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    (www / ARCHIVE).write_bytes(bytes(bad))
    res, out = tmp_path / "resources", tmp_path / "data" / "cifar10.npz"
    checksums = _checksums(f"{base}/{ARCHIVE}", data)  # pins the GOOD archive

    with pytest.raises(ChecksumError) as err:
        fetch_raw("cifar10", res, checksums)
    msg = str(err.value)
    assert ARCHIVE in msg and f"{base}/{ARCHIVE}" in msg
    assert hashlib.md5(data).hexdigest() in msg and hashlib.md5(bad).hexdigest() in msg
    with pytest.raises(ChecksumError):
        build_dataset("cifar10", out, res, checksums)
    assert _all_files(res) == ["raw", "raw/cifar10"]  # no partial download, no extracted dir
    assert _all_files(out.parent) == []  # no bundle, no temp file


def test_url_without_pinned_checksum_is_refused(tmp_path, server, archive):
    base, www, _ = server
    data, _ = archive
    (www / ARCHIVE).write_bytes(data)
    checksums = {"files": [{"dataset": "cifar10", "filename": f"cifar10/{ARCHIVE}", "url": f"{base}/{ARCHIVE}"}]}
    with pytest.raises(ChecksumNotPinned, match=hashlib.sha256(data).hexdigest()):
        fetch_raw("cifar10", tmp_path / "res", checksums)
    with pytest.raises(ChecksumNotPinned):
        build_dataset("cifar10", tmp_path / "out.npz", tmp_path / "res", checksums)
    assert not (tmp_path / "out.npz").exists()


def test_unreachable_url_is_reported(tmp_path, server):
    base, _, _ = server
    checksums = {"files": [{"dataset": "cifar10", "filename": f"cifar10/{ARCHIVE}",
                            "url": f"{base}/nope.tar.gz", "md5": "0" * 32}]}
    with pytest.raises(dl.DownloadError, match="nope.tar.gz"):
        fetch_raw("cifar10", tmp_path / "res", checksums, timeout=5)
    assert _all_files(tmp_path / "res") == ["raw", "raw/cifar10"]


MANUAL = {"files": [{"dataset": "office_caltech10", "filename": "office/office_caltech_10_dataset.zip",
                     "manual": True, "instructions": "see FedBN README", "sha256": None}]}


def test_missing_manual_file_names_the_path(tmp_path):
    res = tmp_path / "resources"
    expected_path = res / "manual" / "office" / "office_caltech_10_dataset.zip"
    with pytest.raises(ManualDataMissing) as err:
        fetch_raw("office_caltech10", res, MANUAL)
    msg = str(err.value)
    assert str(expected_path) in msg and "office_caltech10" in msg and "see FedBN README" in msg
    problems = check_data(["office_caltech10"], res, MANUAL)
    assert len(problems) == 1 and str(expected_path) in problems[0]


def test_manual_file_without_pin_gives_its_sha256(tmp_path):
    res = tmp_path / "resources"
    path = res / "manual" / "office" / "office_caltech_10_dataset.zip"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not really a zip")
    sha = hashlib.sha256(b"not really a zip").hexdigest()
    with pytest.raises(ChecksumNotPinned, match=sha) as err:
        fetch_raw("office_caltech10", res, MANUAL)
    assert "config/checksums.yaml" in str(err.value)
    assert sha in check_data(["office_caltech10"], res, MANUAL)[0]


def _office_zip(path: Path) -> None:
    """A layout-B Office archive: <domain>/<class>/*.png, 5 tiny images per class."""
    from PIL import Image

    from fedcore.data.sources import OFFICE_CLASSES, OFFICE_DOMAINS

    with zipfile.ZipFile(path, "w") as zf:
        for d, dom in enumerate(OFFICE_DOMAINS):
            for c, cls in enumerate(OFFICE_CLASSES):
                for i in range(5):
                    buf = io.BytesIO()
                    Image.new("RGB", (8, 6), (d * 60, c * 25, i * 50)).save(buf, format="PNG")
                    zf.writestr(f"office_caltech_10/{dom}/{cls}/{i}.png", buf.getvalue())


def test_manual_pinned_folder_layout_builds(tmp_path, monkeypatch):
    from fedcore.data import sources

    monkeypatch.setattr(sources, "FEATURE_SHIFT_SIZE", 8)  # keep the test fast (paper scale: 224)
    res = tmp_path / "resources"
    path = res / "manual" / "office" / "office_caltech_10_dataset.zip"
    path.parent.mkdir(parents=True)
    _office_zip(path)
    checksums = {"files": [dict(MANUAL["files"][0], sha256=hashlib.sha256(path.read_bytes()).hexdigest())]}
    out = tmp_path / "office.npz"
    # our own split, not the papers': refused unless the config allows it, and nothing is written
    with pytest.raises(DataError, match="allow_folder_layout=true"):
        build_dataset("office_caltech10", out, res, checksums)
    assert not out.exists()
    build_dataset("office_caltech10", out, res, checksums, allow_folder_layout=True)
    b = load_bundle(out)
    assert b.meta["folder_layout"] and "layout: folders" in b.meta["source"]
    assert b.meta["domains"] == sources.OFFICE_DOMAINS and b.meta["classes"] == sources.OFFICE_CLASSES
    assert len(b.train) == 4 * 10 * 4 and len(b.test) == 4 * 10 * 1
    assert sorted(np.unique(b.test.domain).tolist()) == [0, 1, 2, 3]
    assert b.train.x.shape[1:] == (8, 8, 3)


def test_extract_refuses_path_traversal(tmp_path):
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tf:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(ValueError, match="escape"):
        dl.extract(evil, tmp_path / "out" / "x")
    assert not (tmp_path / "escaped.txt").exists() and _all_files(tmp_path / "out") == []

    evil_zip = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil_zip, "w") as zf:
        zf.writestr("/abs.txt", "hi")
    with pytest.raises(ValueError, match="escape"):
        dl.extract(evil_zip, tmp_path / "out" / "y")
    assert _all_files(tmp_path / "out") == []


def test_verify_file(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"abc")
    dl.verify_file(p, md5=hashlib.md5(b"abc").hexdigest(), sha256=hashlib.sha256(b"abc").hexdigest())
    with pytest.raises(ChecksumError, match=str(p)):
        dl.verify_file(p, sha256="0" * 64)
    with pytest.raises(ValueError, match="no checksum"):
        dl.verify_file(p)


def test_checksums_config_validation(tmp_path):
    good = {"dataset": "cifar10", "filename": "c/a.tgz", "url": "https://x/a.tgz", "md5": "a" * 32}
    validate_checksums({"files": [good]})
    cases = [
        (dict(good, md5="xyz"), "'md5'"),
        (dict(good, sha265="a" * 64), "sha265"),
        (dict(good, filename="../a.tgz"), "'filename'"),
        (dict(good, manual=True), "exactly one of 'url' or 'manual"),
        ({"dataset": "x", "filename": "a", "manual": True}, "'instructions'"),
        (dict(good, url="ftp://x"), "'url'"),
    ]
    for entry, needle in cases:
        with pytest.raises(ChecksumsConfigError, match=needle) as err:
            validate_checksums({"files": [entry]})
        assert "files[0]" in str(err.value)
    bad_yaml = tmp_path / "c.yaml"
    bad_yaml.write_text("files:\n  - {dataset: cifar10, filename: a, url: 'https://x', md5: 12}\n")
    with pytest.raises(ChecksumsConfigError, match=rf"{bad_yaml}.*'md5'"):
        load_checksums(bad_yaml)


def _torchvision_attrs(module: str) -> dict[str, dict[str, object]]:
    """Class attributes of torchvision.datasets.<module>, read from its source without importing torch."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchvision is not installed")
    src = Path(list(spec.submodule_search_locations)[0]) / "datasets" / f"{module}.py"
    out: dict[str, dict[str, object]] = {}
    for node in ast.parse(src.read_text()).body:
        if isinstance(node, ast.ClassDef):
            attrs = out.setdefault(node.name, {})
            for stmt in node.body:
                target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
                if isinstance(target, ast.Name) and getattr(stmt, "value", None) is not None:
                    try:
                        attrs[target.id] = ast.literal_eval(stmt.value)
                    except ValueError:
                        pass
    return out


def test_shipped_checksums_config_matches_torchvision():
    cfg = load_checksums(ROOT / "config" / "checksums.yaml")
    for name in PAPER:
        assert raw_files(name, cfg), name  # every paper dataset has its raw files listed
    by_name = {e["filename"].split("/")[-1] + "@" + e["dataset"]: e for e in cfg["files"]}
    cifar = _torchvision_attrs("cifar")
    for cls, ds in (("CIFAR10", "cifar10"), ("CIFAR100", "cifar100")):
        entry = by_name[f"{cifar[cls]['filename']}@{ds}"]
        assert entry["md5"] == cifar[cls]["tgz_md5"] and entry["url"] == [cifar[cls]["url"]]
    svhn = _torchvision_attrs("svhn")["SVHN"]["split_list"]
    for url, fname, md5 in (svhn["train"], svhn["test"]):
        assert by_name[f"{fname}@svhn"]["md5"] == md5 and by_name[f"{fname}@svhn"]["url"] == [url]
    mnist = _torchvision_attrs("mnist")
    for cls, ds in (("MNIST", "mnist"), ("FashionMNIST", "fashion_mnist")):
        for fname, md5 in mnist[cls]["resources"]:
            entry = by_name[f"{fname}@{ds}"]
            assert entry["md5"] == md5 and entry["url"] == [m + fname for m in mnist[cls]["mirrors"]]
    assert set(DATASETS) >= set(PAPER)


def test_converters_on_synthetic_raw_files(tmp_path, monkeypatch):
    """SVHN label 10 -> 0, idx parsing, notMNIST skipping, FedBN pickle paths, Five-dataset offsets."""
    import gzip
    import struct

    from PIL import Image
    from scipy.io import savemat

    from fedcore.data import sources

    rng = np.random.default_rng(0)
    for split, n in (("train", 20), ("test", 10)):
        savemat(tmp_path / f"{split}_32x32.mat", {"X": rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8),
                                                  "y": (np.arange(n) % 10 + 1).reshape(-1, 1)})
    svhn = sources.svhn([tmp_path / "train_32x32.mat", tmp_path / "test_32x32.mat"])
    assert svhn.train.y[:10].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]

    idx_dir = tmp_path / "idx"
    idx_dir.mkdir()
    for prefix, n in (("train", 20), ("t10k", 10)):
        for kind, arr in (("images-idx3", rng.integers(0, 256, (n, 28, 28))), ("labels-idx1", np.arange(n) % 10)):
            header = bytes([0, 0, 8, arr.ndim]) + b"".join(struct.pack(">I", s) for s in arr.shape)
            with gzip.open(idx_dir / f"{prefix}-{kind}-ubyte.gz", "wb") as fh:
                fh.write(header + arr.astype(np.uint8).tobytes())
    mnist = sources.mnist([idx_dir])
    assert mnist.train.x.shape == (20, 28, 28, 3) and mnist.test.y.tolist() == list(range(10))
    assert np.array_equal(mnist.train.x[..., 0], mnist.train.x[..., 2])  # grey replicated

    letters = tmp_path / "nm" / "notMNIST_small"
    for letter in sources.NOTMNIST_CLASSES:
        (letters / letter).mkdir(parents=True)
        for i in range(10):
            Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(letters / letter / f"{i}.png")
    (letters / "A" / "broken.png").write_bytes(b"\x89PNG truncated")
    notmnist = sources.notmnist([tmp_path / "nm"])
    assert (len(notmnist.train), len(notmnist.test)) == (90, 10) and notmnist.meta["skipped_files"] == ["A/broken.png"]

    five = sources.five_dataset({"svhn": svhn, "cifar10": svhn, "notmnist": notmnist,
                                 "fashion_mnist": mnist, "mnist": mnist})
    assert five.train.x.shape[1:] == (32, 32, 3) and five.num_classes == 50
    assert np.array_equal(five.train.y // 10, five.train.domain)
    assert np.bincount(five.train.domain).tolist() == [20, 20, 90, 20, 20]

    # FedBN pickles store paths relative to FedBN's own data root; they are resolved against the archive.
    monkeypatch.setattr(sources, "FEATURE_SHIFT_SIZE", 8)
    office = tmp_path / "office" / "office_caltech_10"
    for dom in sources.OFFICE_DOMAINS:
        for split in ("train", "test"):
            paths, labels = [], []
            for cls in sources.OFFICE_CLASSES[:2]:
                (office / dom / cls).mkdir(parents=True, exist_ok=True)
                img = office / dom / cls / f"{split}.jpg"
                Image.new("RGB", (12, 10), (40, 80, 120)).save(img)
                paths.append(f"../data/office_caltech_10/{dom}/{cls}/{img.name}")
                labels.append(cls)
            with open(office / f"{dom}_{split}.pkl", "wb") as fh:
                pickle.dump([np.array(paths), np.array(labels)], fh)
    b = sources.office_caltech10([tmp_path / "office"])
    assert b.train.y.tolist() == [0, 1] * 4 and b.train.domain.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert b.train.x.shape == (8, 8, 8, 3) and "FedBN pickles" in b.meta["source"]
