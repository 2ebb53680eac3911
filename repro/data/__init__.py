"""Datasets with checksums: where each lives, how it is prepared, and how it is verified.

A dataset is a folder whose files are listed, with their SHA-256, in a manifest. Manifests of
data we can make or know in advance ship with the kit (`manifests/NAME.sha256`); data a user
brings (ImageNet) or fetches at a pinned revision (WikiText-103) gets its manifest written at
`prepare` time, beside the data. A run refuses to start unless its dataset verifies.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

MANIFESTS = Path(__file__).parent / "manifests"
LOCAL_MANIFEST = "MANIFEST.sha256"
SYNTHETIC = "synthetic"
# A file changed within this long before it was hashed may change again with the same ctime (file
# systems keep coarse timestamps); its cached hash is not trusted, as git treats "racily clean" entries.
RACY_NS = 2_000_000_000


class DataError(RuntimeError):
    """A dataset that is missing or does not match its manifest; the message names the file."""


def data_root() -> Path:
    return Path(os.environ.get("REPRO_DATA", "data"))


def staged_roots() -> list[Path]:
    """Read-only places where datasets may already be staged (never copied into the project)."""
    env = os.environ.get("REPRO_STAGED_DATA")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    return [Path(__file__).resolve().parents[3] / "shared" / "data"]


def cache_path() -> Path:
    """$XDG_CACHE_HOME/repro, else beside the data: the home directory may be unwritable (an image run
    as any uid); the data folder is where a run writes anyway."""
    base = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else data_root() / ".cache"
    return base / "repro" / "verify-cache.json"


def read_manifest(path: Path) -> dict[str, str]:
    """`sha256sum` format: '<hex>  <relative path>' per line -> {path: hex}."""
    entries = {}
    for line in path.read_text().splitlines():
        if line.strip():
            digest, _, name = line.partition("  ")
            entries[name.strip()] = digest.strip()
    return entries


def write_manifest(path: Path, entries: dict[str, str]) -> None:
    path.write_text("".join(f"{entries[name]}  {name}\n" for name in sorted(entries)))


def manifest_digest(entries: dict[str, str]) -> str:
    """One SHA-256 for the whole dataset: of its sorted manifest."""
    text = "".join(f"{entries[name]}  {name}\n" for name in sorted(entries))
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_file(path: Path | str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def stat_key(stat: os.stat_result) -> list[int]:
    """What a cached hash is valid for. Size and mtime alone are easy to keep while changing bytes
    (`cp -p`, `rsync -t`, `touch -r`, a restored backup); ctime is not: every write or utime call sets
    it to the current time, and no system call sets it back. Inode and device change when the file
    is replaced or the tree is moved to another disk."""
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


class HashCache:
    """File hashes keyed on (path, size, mtime, ctime, inode, device): a second verify of an unchanged
    tree only stats.

    Paths are plain strings here: pathlib's per-call overhead would dominate a cached verify.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            self.entries: dict[str, list] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.dirty = False

    def lookup(self, file: str, stat: os.stat_result) -> str | None:
        hit = self.entries.get(file)  # [*stat_key, hashed_at_ns, digest]
        key = stat_key(stat)
        # an entry of another layout (an older kit's cache) is no entry: its file is hashed again
        if not isinstance(hit, list) or len(hit) != len(key) + 2 or not isinstance(hit[-1], str):
            return None
        if hit[:-2] != key or stat.st_ctime_ns > hit[-2] - RACY_NS:
            return None
        return hit[-1]

    def store(self, file: str, stat: os.stat_result, digest: str, hashed_at_ns: int) -> None:
        self.entries[file] = [*stat_key(stat), hashed_at_ns, digest]
        self.dirty = True

    def save(self) -> None:
        """Best effort: on a read-only file system the next verify hashes again, and that is all."""
        if self.dirty:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")  # concurrent verifies each write their own
                tmp.write_text(json.dumps(self.entries))
                os.replace(tmp, self.path)
            except OSError:
                pass


@dataclass(frozen=True)
class Verified:
    """A dataset that matched its manifest, and how that was established (the run's repro.data_check)."""

    root: Path
    sha256: str  # of the sorted manifest: the dataset's identity
    check: str


def verify_tree(root: Path, entries: dict[str, str], deep: bool = False, cache: HashCache | None = None) -> str:
    """Check every manifest entry under `root`; raise DataError naming the first bad file.

    A file is hashed unless the cache holds the manifest's digest for it under the same stat key;
    so a mismatch is always a fresh hash, never a stale cache entry. Returns which check ran.
    """
    cache = cache or HashCache(cache_path())
    base = os.path.abspath(root) + os.sep
    files, stats, todo = [], [], []
    for name in sorted(entries):
        file = base + name
        try:
            stat = os.stat(file)
        except FileNotFoundError:
            raise DataError(f"{root / name}: missing (listed in the manifest of {root})") from None
        files.append(file)
        stats.append(stat)
        if deep or cache.lookup(file, stat) != entries[name]:
            todo.append((file, stat))
    hashed_at, fresh = time.time_ns(), {}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for (file, stat), digest in zip(todo, pool.map(sha256_file, [f for f, _ in todo])):
            cache.store(file, stat, digest, hashed_at)
            fresh[file] = digest
    cache.save()
    for file, stat, name in zip(files, stats, sorted(entries)):
        got = fresh.get(file) or cache.lookup(file, stat)
        if got != entries[name]:
            raise DataError(f"{root / name}: checksum mismatch (expected {entries[name][:16]}..., got {got[:16]}...)")
    if deep or len(todo) == len(files):
        return f"full: all {len(files)} files hashed"
    return (f"quick: {len(todo)} of {len(files)} files hashed, the others unchanged since hashed "
            "(same size, mtime, ctime, inode and device)")


@dataclass(frozen=True)
class Dataset:
    name: str
    description: str
    prepare_hint: str
    make: Callable[[Path], None] | None = None  # writes the data into a folder
    synthetic: bool = False  # generated in memory by the workload: nothing on disk to verify

    def shipped_manifest(self) -> Path | None:
        path = MANIFESTS / f"{self.name}.sha256"
        return path if path.exists() else None

    def locate(self) -> Path:
        """The folder holding this dataset: the data root first, then staged copies."""
        if self.synthetic:
            return data_root()
        for base in [data_root(), *staged_roots()]:
            if (base / self.name).is_dir():
                return base / self.name
        raise DataError(
            f"dataset {self.name!r} not found in {data_root() / self.name} or the staged copies "
            f"({', '.join(map(str, staged_roots()))}); prepare it with: {self.prepare_hint}"
        )

    def manifest(self, root: Path) -> dict[str, str]:
        path = self.shipped_manifest() or root / LOCAL_MANIFEST
        if not path.exists():
            raise DataError(f"{root}: no manifest ({path}); prepare it with: {self.prepare_hint}")
        return read_manifest(path)

    def verify(self, deep: bool = False) -> Verified:
        """The folder and dataset SHA-256 once every file matches; DataError naming the file otherwise."""
        if self.synthetic:
            return Verified(self.locate(), SYNTHETIC, "none: generated by the workload")
        root = self.locate()
        entries = self.manifest(root)
        try:
            check = verify_tree(root, entries, deep=deep)
        except DataError as error:
            raise DataError(f"{error}; make it again with: {self.prepare_hint}") from None
        return Verified(root, manifest_digest(entries), check)


def hash_tree(root: Path, names: Iterable[str]) -> dict[str, str]:
    names = sorted(names)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(names, pool.map(lambda n: sha256_file(root / n), names)))
