"""The training corpus: the running interpreter's standard library sources (offline, PSF-licensed).

Every machine that runs loopline has a CPython ``Lib/`` directory, so the
corpus needs no download. The Python Software Foundation License allows
redistributing works derived from it, which covers a model trained on it.

The corpus is a pure function of ``(Python version, CorpusSpec)``: the file
list is filtered by fixed rules, ordered by the SHA-256 of each relative path
(a fixed shuffle that mixes packages and does not depend on directory listing
order), and cut at a fixed byte budget. The held-out split is chosen by the
same path hash, so a file's split does not move when other files are added or
removed -- and across Python versions the split of a path that exists in both
stays the same. NOTE: the *contents* differ between Python versions (3.11.7's
``Lib/`` is not 3.12's): :func:`corpus_info` records the exact version and a
digest of the text, and the model card must quote them.
"""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

LICENSE = "PSF-2.0 (Python Software Foundation License Version 2)"
LICENSE_URL = "https://docs.python.org/3/license.html"

# Directories left out: third-party packages (other licenses), the test suites (large, full of
# deliberately odd data), codec tables (walls of hex) and byte-code caches.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"})


@dataclass(frozen=True)
class CorpusSpec:
    """What goes into the corpus (every field is part of its identity)."""

    root: str | None = None  # None: sysconfig.get_paths()["stdlib"] of the running interpreter
    max_bytes: int = 16_000_000  # total budget over both splits, in UTF-8 bytes
    max_file_bytes: int = 1_000_000  # larger files are skipped
    heldout_per_mille: int = 30  # a file is held out when its path hash mod 1000 is below this

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"CorpusSpec.max_bytes={self.max_bytes}; allowed: a positive integer")
        if self.max_file_bytes <= 0:
            raise ValueError(f"CorpusSpec.max_file_bytes={self.max_file_bytes}; allowed: a positive integer")
        if not 0 < self.heldout_per_mille < 1000:
            raise ValueError(f"CorpusSpec.heldout_per_mille={self.heldout_per_mille}; allowed: 1..999")

    def resolved_root(self) -> Path:
        return Path(self.root if self.root is not None else sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class Document:
    """One source file: its path relative to the root and its text (``\\n`` line ends)."""

    path: str
    text: str


def _path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")


def is_heldout(rel: str, spec: CorpusSpec) -> bool:
    """Whether the file at relative path ``rel`` belongs to the held-out split."""
    return _path_hash(rel) % 1000 < spec.heldout_per_mille


def _candidates(root: Path, spec: CorpusSpec) -> list[str]:
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory (CorpusSpec.root)")
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        if not p.is_file() or p.stat().st_size > spec.max_file_bytes:
            continue
        out.append(rel.as_posix())
    # NOTE: order by path hash (ties impossible: distinct paths), never by rglob's filesystem order.
    return sorted(out, key=lambda r: (_path_hash(r), r))


def documents(spec: CorpusSpec = CorpusSpec()) -> list[Document]:
    """Every document of the corpus (both splits) in its fixed order, within the byte budget."""
    root = spec.resolved_root()
    docs, total = [], 0
    for rel in _candidates(root, spec):
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a few legacy files are not UTF-8; a fixed rule, so still deterministic
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        size = len(text.encode("utf-8"))
        if total + size > spec.max_bytes:
            break
        docs.append(Document(rel, text))
        total += size
    return docs


def split(spec: CorpusSpec = CorpusSpec()) -> tuple[list[Document], list[Document]]:
    """``(train, heldout)`` documents; training never reads the held-out files."""
    docs = documents(spec)
    return [d for d in docs if not is_heldout(d.path, spec)], [d for d in docs if is_heldout(d.path, spec)]


@dataclass(frozen=True)
class CorpusInfo:
    """What the model card says about the corpus."""

    name: str
    license: str
    license_url: str
    python_version: str
    implementation: str
    root: str
    train_files: int
    train_bytes: int
    heldout_files: int
    heldout_bytes: int
    sha256: str  # of every document's path and text, in order: identifies the exact corpus
    spec: dict

    def to_dict(self) -> dict:
        return asdict(self)


def corpus_info(spec: CorpusSpec = CorpusSpec()) -> CorpusInfo:
    """Name, license, version, sizes and digest of the corpus ``spec`` selects on this interpreter."""
    train, heldout = split(spec)
    digest = hashlib.sha256()
    for d in documents(spec):
        digest.update(d.path.encode("utf-8") + b"\0" + d.text.encode("utf-8") + b"\0")
    version = platform.python_version()
    return CorpusInfo(
        name=f"CPython {version} standard library (Lib/*.py without tests, site-packages and encodings)",
        license=LICENSE, license_url=LICENSE_URL, python_version=version,
        implementation=platform.python_implementation(), root=str(spec.resolved_root()),
        train_files=len(train), train_bytes=sum(len(d.text.encode("utf-8")) for d in train),
        heldout_files=len(heldout), heldout_bytes=sum(len(d.text.encode("utf-8")) for d in heldout),
        sha256=digest.hexdigest(), spec=asdict(spec),
    )
