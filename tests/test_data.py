"""Checksummed data: manifests, the verify cache, and runs that refuse bad or missing data."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from conftest import REPO
from repro.data import DataError, HashCache, read_manifest, verify_tree
from repro.data.sets import DATASETS, make_digits


def test_digits_regenerate_to_the_shipped_manifest(tmp_path: Path) -> None:
    make_digits(tmp_path)
    manifest = read_manifest(DATASETS["digits"].shipped_manifest())
    assert len(manifest) == 1797
    verify_tree(tmp_path, manifest, deep=True, cache=HashCache(tmp_path / "cache.json"))
    assert len(list((tmp_path / "val").rglob("*.bmp"))) == 364  # every 5th image of each class


def test_wikitext2_manifest_matches_its_published_checksums() -> None:
    shipped = read_manifest(DATASETS["wikitext-2"].shipped_manifest())
    staged = read_manifest(REPO.parent / "shared" / "data" / "wikitext-2" / "SHA256SUMS")
    assert shipped == staged


def test_cache_skips_unchanged_files_and_deep_rehashes(tmp_path: Path) -> None:
    file = tmp_path / "a.txt"
    file.write_bytes(b"0123456789")
    entries = {"a.txt": hashlib.sha256(b"0123456789").hexdigest()}
    cache = HashCache(tmp_path / "cache.json")
    verify_tree(tmp_path, entries, cache=cache)
    stat = file.stat()
    file.write_bytes(b"9876543210")  # same size; restore the mtime so only content differs
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    verify_tree(tmp_path, entries, cache=HashCache(tmp_path / "cache.json"))  # cached: not rehashed
    with pytest.raises(DataError, match=r"a\.txt: checksum mismatch"):
        verify_tree(tmp_path, entries, deep=True, cache=HashCache(tmp_path / "cache.json"))


def test_corrupted_file_refuses_the_run_and_names_it(repro, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(REPO / "data" / "digits", data / "digits")
    victim = data / "digits" / "train" / "3" / sorted(os.listdir(data / "digits" / "train" / "3"))[0]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x01")
    repro.env["REPRO_DATA"] = str(data)
    out = repro("run", "vgg16", "--max-steps", "1")
    assert out.returncode == 2
    assert f"{victim}: checksum mismatch" in out.stderr
    assert not (repro.cwd / "runs").exists()


def test_missing_dataset_says_how_to_prepare_it(repro, tmp_path: Path) -> None:
    repro.env["REPRO_DATA"] = str(tmp_path / "empty")
    repro.env["REPRO_STAGED_DATA"] = str(tmp_path / "nothing-staged")
    out = repro("run", "gpt2", "--max-steps", "1")
    assert out.returncode == 2
    assert "dataset 'wikitext-2' not found" in out.stderr
    assert "prepare it with: repro data prepare wikitext-2" in out.stderr
