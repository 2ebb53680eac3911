"""The kit's datasets and how each is made."""
from __future__ import annotations

from pathlib import Path

from repro.data import LOCAL_MANIFEST, SYNTHETIC, DataError, Dataset, hash_tree, write_manifest

DIGITS_SIZE = 32
DIGITS_VAL_EVERY = 5  # every 5th image of each class is validation: a fixed, stratified 80/20 split

# The Hub revision of `Salesforce/wikitext` the paper-scale runs read.
WIKITEXT_REVISION = "b08601e04326c79dfdd32d625aee71d232d685c3"

# MD5s published with ILSVRC2012 (the official archives).
IMAGENET_ARCHIVES = {
    "ILSVRC2012_img_train.tar": "1d675b47d978889d74fa0da5fadfb00e",
    "ILSVRC2012_img_val.tar": "29b22e2961454d5413ddabcf34fc5622",
    "ILSVRC2012_devkit_t12.tar.gz": "fa75699e90414af021442c21a62c3abf",
}


def make_digits(root: Path) -> None:
    """scikit-learn's bundled 8x8 digits as a 32x32 RGB ImageFolder (uncompressed BMP, so bytes are stable)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    seen_of_class = [0] * 10
    for index, (image, label) in enumerate(zip(digits.images, digits.target)):
        split = "val" if seen_of_class[label] % DIGITS_VAL_EVERY == 0 else "train"
        seen_of_class[label] += 1
        pixels = (image * (255.0 / 16.0)).round().astype(np.uint8)
        big = np.kron(pixels, np.ones((DIGITS_SIZE // 8, DIGITS_SIZE // 8), dtype=np.uint8))
        folder = root / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.stack([big] * 3, axis=-1), "RGB").save(folder / f"{index:04d}.bmp")


def _write_wikitext(root: Path, config: str, splits: dict[str, str]) -> None:
    from datasets import load_dataset

    for split, filename in splits.items():
        rows = load_dataset("Salesforce/wikitext", config, split=split, revision=WIKITEXT_REVISION)
        (root / filename).write_text("".join(rows["text"]))


def make_wikitext2(root: Path) -> None:
    """Train on the validation split, validate on the test split (the smoke convention)."""
    _write_wikitext(root, "wikitext-2-v1", {"validation": "valid.txt", "test": "test.txt"})


def make_wikitext103(root: Path) -> None:
    _write_wikitext(root, "wikitext-103-v1", {"train": "train.txt", "validation": "valid.txt", "test": "test.txt"})
    write_manifest(root / LOCAL_MANIFEST, hash_tree(root, ["train.txt", "valid.txt", "test.txt"]))


def make_imagenet(root: Path) -> None:
    """Check the user's official archives, extract them with torchvision and record the tree."""
    import hashlib

    from torchvision.datasets import ImageNet

    for name, md5 in IMAGENET_ARCHIVES.items():
        path = root / name
        if not path.exists():
            raise DataError(f"{path}: missing; download ILSVRC2012 from image-net.org into {root}")
        with open(path, "rb") as f:
            got = hashlib.file_digest(f, "md5").hexdigest()
        if got != md5:
            raise DataError(f"{path}: MD5 mismatch (expected {md5}, got {got})")
    for split in ("train", "val"):
        ImageNet(str(root), split=split)
    files = [str(p.relative_to(root)) for split in ("train", "val") for p in (root / split).rglob("*") if p.is_file()]
    write_manifest(root / LOCAL_MANIFEST, hash_tree(root, files))


DATASETS: dict[str, Dataset] = {
    d.name: d
    for d in (
        Dataset("digits", "scikit-learn's digits, 32x32 RGB ImageFolder (smoke images)", "repro data prepare digits", make_digits),
        Dataset("wikitext-2", "WikiText-2 (v1, tokenized): smoke text", "repro data prepare wikitext-2", make_wikitext2),
        Dataset("wikitext-103", "WikiText-103 (v1, tokenized): paper text", "repro data prepare wikitext-103", make_wikitext103),
        Dataset(
            "imagenet", "ILSVRC2012, user-provided archives", "place the ILSVRC2012 archives in "
            "$REPRO_DATA/imagenet, then: repro data prepare imagenet", make_imagenet,
        ),
        Dataset(
            SYNTHETIC, "random samples of the workload's shapes, for throughput checks (nothing learns)",
            "nothing to prepare", synthetic=True,
        ),
    )
}


def dataset(name: str) -> Dataset:
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; valid datasets: {', '.join(DATASETS)}")
    return DATASETS[name]


def prepare(name: str, root: Path) -> Path:
    """Make `name` under `root` unless an existing copy (here or staged) already verifies."""
    spec = dataset(name)
    try:
        return spec.verify().root
    except DataError:
        pass
    target = root / name
    target.mkdir(parents=True, exist_ok=True)
    spec.make(target)
    return spec.verify(deep=True).root
