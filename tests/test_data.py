"""Checksummed data: manifests, the verify cache, and runs that refuse bad or missing data."""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import REPO
from repro.data import RACY_NS, DataError, HashCache, read_manifest, verify_tree
from repro.data.sets import DATASETS, make_digits

pytestmark = pytest.mark.units


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


def rewrite_keeping_times(file: Path, content: bytes) -> None:
    """What `cp -p`, `rsync -t` or a restored backup does: new bytes, the same size and mtime."""
    stat = file.stat()
    assert len(content) == stat.st_size
    file.write_bytes(content)
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file.stat().st_mtime_ns == stat.st_mtime_ns


def test_quick_check_sees_rewrites_that_keep_size_and_mtime(tmp_path: Path) -> None:
    file = tmp_path / "a.txt"
    file.write_bytes(b"0123456789")
    entries = {"a.txt": hashlib.sha256(b"0123456789").hexdigest()}
    cache = tmp_path / "cache.json"
    assert verify_tree(tmp_path, entries, cache=HashCache(cache)) == "full: all 1 files hashed"
    rewrite_keeping_times(file, b"9876543210")
    with pytest.raises(DataError, match=r"a\.txt: checksum mismatch"):
        verify_tree(tmp_path, entries, cache=HashCache(cache))
    # the opposite: the good bytes restored with the same mtime verify at once, without --deep
    rewrite_keeping_times(file, b"0123456789")
    verify_tree(tmp_path, entries, cache=HashCache(cache))


def test_cache_serves_files_unchanged_since_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_bytes(name.encode())
    entries = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("a.txt", "b.txt")}
    cache = tmp_path / "cache.json"
    verify_tree(tmp_path, {"a.txt": entries["a.txt"]}, cache=HashCache(cache))
    # hashed "later" than the files' last change by more than the racy window, so trusted from now on
    later = time.time_ns() + 2 * RACY_NS
    monkeypatch.setattr(time, "time_ns", lambda: later)
    assert verify_tree(tmp_path, entries, cache=HashCache(cache)) == "full: all 2 files hashed"
    assert verify_tree(tmp_path, entries, cache=HashCache(cache)).startswith("quick: 0 of 2 files hashed")
    assert verify_tree(tmp_path, entries, deep=True, cache=HashCache(cache)) == "full: all 2 files hashed"


def test_corrupted_file_refuses_the_run_and_names_it(repro, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(REPO / "data" / "digits", data / "digits")
    victim = data / "digits" / "train" / "3" / sorted(os.listdir(data / "digits" / "train" / "3"))[0]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x01")
    repro.env["REPRO_DATA"] = str(data)
    out = repro.here("run", "vgg16", "--max-steps", "1")
    assert out.returncode == 2
    assert f"{victim}: checksum mismatch" in out.stderr
    assert not (repro.cwd / "runs").exists()


def test_missing_dataset_says_how_to_prepare_it(repro, tmp_path: Path) -> None:
    repro.env["REPRO_DATA"] = str(tmp_path / "empty")
    repro.env["REPRO_STAGED_DATA"] = str(tmp_path / "nothing-staged")
    out = repro.here("run", "gpt2", "--max-steps", "1")
    assert out.returncode == 2
    assert "dataset 'wikitext-2' not found" in out.stderr
    assert "prepare it with: repro data prepare wikitext-2" in out.stderr


def test_run_catches_a_corruption_that_keeps_size_and_mtime(repro, tmp_path: Path) -> None:
    """The quick check of `repro run` sees a changed byte although size and mtime are restored."""
    data = tmp_path / "data"
    shutil.copytree(REPO / "data" / "digits", data / "digits")
    repro.env |= {"REPRO_DATA": str(data), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    verify = repro.here("data", "verify", "digits")
    assert verify.returncode == 0 and "full: all 1797 files hashed" in verify.stdout, verify.stderr
    victim = data / "digits" / "train" / "3" / sorted(os.listdir(data / "digits" / "train" / "3"))[0]
    original = victim.read_bytes()
    rewrite_keeping_times(victim, original[:-1] + bytes([original[-1] ^ 1]))
    out = repro.here("run", "vgg16", "--max-steps", "1")
    assert out.returncode == 2
    assert out.stderr.splitlines() == [f"repro: {victim}: checksum mismatch (expected "
                                       f"{hashlib.sha256(original).hexdigest()[:16]}..., got "
                                       f"{hashlib.sha256(victim.read_bytes()).hexdigest()[:16]}...); "
                                       "make it again with: repro data prepare digits"]
    assert not (repro.cwd / "runs").exists() and not (repro.cwd / "mlflow.db").exists()
