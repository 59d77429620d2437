"""FedOTP's CLIP datasets (Caltech101, Flowers102, OxfordPets, DTD): download -> verify -> extract -> convert,
against a local HTTP server serving tiny archives in the official layouts that the test builds."""
from __future__ import annotations

import hashlib
import http.server
import io
import json
import tarfile
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedcore.data.arrays import load_bundle
from fedcore.data.registry import build_dataset
from fedcore.data.sources_clip import CALTECH_IGNORED, coop_class_split, load_clip_image


@pytest.fixture()
def server(tmp_path):
    """Serve tmp_path/www on 127.0.0.1 (ephemeral port); yields (base url, www dir)."""
    www = tmp_path / "www"
    www.mkdir()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(www), **kw)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", www
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def _jpg(seed: int, w: int = 40, h: int = 30) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG")
    return buf.getvalue()


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, raw in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tf.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def _serve(www: Path, base: str, dataset: str, archives: dict[str, bytes]) -> dict:
    entries = []
    for name, data in archives.items():
        (www / name).write_bytes(data)
        entries.append({"dataset": dataset, "filename": f"{dataset}/{name}", "url": f"{base}/{name}",
                        "md5": hashlib.md5(data).hexdigest()})
    return {"files": entries}


def _build(tmp_path, name, checksums):
    out = tmp_path / f"{name}.npz"
    build_dataset(name, out, tmp_path / "resources", checksums)
    return load_bundle(out)


def test_coop_split_sizes_match_table_a1():
    """CoOp's read_and_split_data per class: DTD's 47 x 120 images -> 2,820 train / 1,692 test (Table A1)."""
    items = {c: list(range(120)) for c in range(47)}
    train, test = coop_class_split(items, np.random.default_rng(0))
    assert (len(train), len(test)) == (2820, 1692)


def test_clip_view_is_shorter_side_then_centre_crop(tmp_path):
    p = tmp_path / "a.jpg"
    p.write_bytes(_jpg(0, 80, 40))
    assert load_clip_image(p, 16).shape == (16, 16, 3)


@pytest.mark.parametrize("w, h", [(500, 375), (375, 500), (333, 500), (301, 227), (224, 224), (250, 250)])
def test_clip_view_has_torchvision_resize_and_centre_crop_geometry(tmp_path, w, h):
    """The official code's test view (Dassl: torchvision Resize(224, bicubic) + CenterCrop(224) on the PIL image),
    pixel for pixel: torchvision truncates the long side and rounds the crop offset (500 x 375 -> 298, not 299)."""
    from torchvision import transforms

    rgb = np.random.default_rng(w * h).integers(0, 256, (h, w, 3), dtype=np.uint8)  # noise: a shifted crop shows
    p = tmp_path / "a.png"
    Image.fromarray(rgb).save(p)
    view = transforms.Compose([transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC),
                               transforms.CenterCrop(224)])
    with Image.open(p) as im:
        theirs = np.asarray(view(im.convert("RGB")), np.uint8)
    assert np.array_equal(load_clip_image(p), theirs)


def test_dtd_and_caltech101_folders_through_http(tmp_path, server):
    base, www = server
    dtd = {f"dtd/images/{c}/{c}_{i:04d}.jpg": _jpg(10 * k + i) for k, c in enumerate(["banded", "zigzagged"])
           for i in range(10)}
    dtd["dtd/labels/train1.txt"] = b"unused\n"
    b = _build(tmp_path, "dtd", _serve(www, base, "dtd", {"dtd-r1.0.1.tar.gz": _tar(dtd)}))
    assert b.meta["classes"] == ["banded", "zigzagged"] and b.train.x.shape[1:] == (224, 224, 3)
    assert np.bincount(b.train.y).tolist() == [5, 5] and np.bincount(b.test.y).tolist() == [3, 3]  # 5/2/3 of 10
    assert "seeded" in b.meta["split"]

    folders = ["Faces", "airplanes", "accordion", *CALTECH_IGNORED]
    inner = _tar({f"101_ObjectCategories/{f}/image_{i:04d}.jpg": _jpg(100 + 10 * k + i)
                  for k, f in enumerate(folders) for i in range(6)})
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("caltech-101/101_ObjectCategories.tar.gz", inner)
    b = _build(tmp_path, "caltech101", _serve(www, base, "caltech101", {"caltech-101.zip": buf.getvalue()}))
    assert b.meta["classes"] == ["face", "accordion", "airplane"]  # sorted folders, CoOp's names, ignored dropped
    assert np.bincount(b.train.y).tolist() == [3] * 3 and np.bincount(b.test.y).tolist() == [2] * 3  # 3/1/2 of 6


def test_oxford_pets_and_flowers102_through_http(tmp_path, server):
    base, www = server
    names = {"Abyssinian": 1, "american_bulldog": 2}
    images, trainval, test = {}, [], []
    for breed, label in names.items():
        for i in range(1, 16):
            images[f"images/{breed}_{i}.jpg"] = _jpg(label * 100 + i)
            (trainval if i <= 10 else test).append(f"{breed}_{i} {label} 1 1")
    ann = {"annotations/trainval.txt": "\n".join(trainval).encode(), "annotations/test.txt": "\n".join(test).encode()}
    b = _build(tmp_path, "oxford_pets", _serve(www, base, "oxford_pets",
                                              {"images.tar.gz": _tar(images), "annotations.tar.gz": _tar(ann)}))
    assert b.meta["classes"] == ["abyssinian", "american_bulldog"]
    assert np.bincount(b.train.y).tolist() == [8, 8] and np.bincount(b.test.y).tolist() == [5, 5]  # 10 - round(2)

    from scipy.io import savemat

    labels = np.repeat([1, 2, 3], 10)
    mat = io.BytesIO()
    savemat(mat, {"labels": labels[None, :]})
    jpgs = _tar({f"jpg/image_{i + 1:05d}.jpg": _jpg(500 + i) for i in range(len(labels))})
    b = _build(tmp_path, "flowers102", _serve(www, base, "flowers102",
                                             {"102flowers.tgz": jpgs, "imagelabels.mat": mat.getvalue()}))
    assert len(b.meta["classes"]) == 102 and b.meta["classes"][0] == "pink primrose"
    assert b.meta["classes"][59] == "pink-yellow dahlia" and b.meta["classes"][77] == "lotus lotus"  # CoOp's names
    assert np.bincount(b.train.y).tolist() == [5] * 3 and np.bincount(b.test.y).tolist() == [3] * 3


def test_flowers102_names_are_coop_cat_to_name():
    """CoOp's prompts name the flowers by cat_to_name.json; torchvision's list differs in labels 60 and 78."""
    from fedcore.data.sources_clip import flowers102_classnames

    names = flowers102_classnames()
    # label (1-based) -> cat_to_name.json entry (CoOp's DATASETS.md file; FedOTP's oxford_flowers.py reads it)
    coop = {1: "pink primrose", 41: "barbeton daisy", 59: "orange dahlia", 60: "pink-yellow dahlia",
            77: "passion flower", 78: "lotus lotus", 79: "toad lily", 102: "blackberry lily"}
    assert {k: names[k - 1] for k in coop} == coop
    assert len(names) == 102 and not any("?" in n for n in names)


def test_coop_split_file_wins_when_given(tmp_path):
    from fedcore.data.sources_clip import dtd

    root = tmp_path / "dtd" / "images"
    for c in ("banded", "zigzagged"):
        (root / c).mkdir(parents=True)
        for i in range(4):
            (root / c / f"{i}.jpg").write_bytes(_jpg(i))
    split = {"train": [["banded/0.jpg", 0, "banded"], ["zigzagged/1.jpg", 1, "zigzagged"]],
             "val": [], "test": [["zigzagged/2.jpg", 1, "zigzagged"]]}
    (tmp_path / "split_zhou_DescribableTextures.json").write_text(json.dumps(split))
    b = dtd([tmp_path / "dtd", tmp_path / "split_zhou_DescribableTextures.json"], size=16)
    assert b.train.y.tolist() == [0, 1] and b.test.y.tolist() == [1]
    assert b.meta["split"] == "CoOp split_zhou_DescribableTextures.json"


def test_shipped_checksums_match_torchvision():
    from torchvision.datasets import DTD, Flowers102, OxfordIIITPet

    from fedcore.data.registry import load_checksums

    root = Path(__file__).resolve().parents[1]
    by = {e["filename"]: e for e in load_checksums(root / "config" / "checksums.yaml")["files"]}
    assert by["dtd/dtd-r1.0.1.tar.gz"]["md5"] == DTD._MD5 and by["dtd/dtd-r1.0.1.tar.gz"]["url"] == [DTD._URL]
    for fname, md5 in (Flowers102._file_dict["image"], Flowers102._file_dict["label"]):
        assert by[f"flowers102/{fname}"]["md5"] == md5
        assert by[f"flowers102/{fname}"]["url"] == [Flowers102._download_url_prefix + fname]
    for url, md5 in OxfordIIITPet._RESOURCES:
        assert by[f"oxford_pets/{url.rsplit('/', 1)[1]}"] == {**by[f"oxford_pets/{url.rsplit('/', 1)[1]}"],
                                                             "md5": md5, "url": [url]}
    assert by["caltech101/caltech-101.zip"]["md5"] == "3138e1922a9193bfa496528edbbc45d0"  # Caltech101.download
