"""The training corpus: the running interpreter's standard library sources (offline, PSF-licensed),
optionally joined by the ``.py`` sources of installed, permissively licensed distributions.

Every machine that runs loopline has a CPython ``Lib/`` directory, so the
corpus needs no download. The Python Software Foundation License allows
redistributing works derived from it, which covers a model trained on it.
``CorpusSpec.packages`` adds installed distributions (found through
``importlib.metadata``: the files their ``RECORD`` lists), each accepted only
when its license metadata is on the allow-list of :mod:`loopline.train.licenses`.

The corpus is a pure function of ``(Python and package versions, CorpusSpec)``: the file
list is filtered by fixed rules, ordered by the SHA-256 of each relative path
(a fixed shuffle that mixes packages and does not depend on directory listing
order), and cut at a fixed byte budget. A distribution's files enter that one
ordering under paths prefixed by the distribution's name (``numpy:numpy/linalg/_linalg.py``),
so they can never collide with a standard-library path. The held-out split is chosen by the
same path hash, so a file's split does not move when other files or whole packages are added or
removed -- and across Python versions the split of a path that exists in both
stays the same. NOTE: the *contents* differ between Python versions (3.11.7's
``Lib/`` is not 3.12's) and package versions: :func:`corpus_info` records the exact versions and a
digest of the text, and the model card must quote them.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import re
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePath, PurePosixPath

from loopline.errors import InvalidRequestError
from loopline.train.licenses import ALLOWED_SUMMARY, LicenseRefused, license_verdict

LICENSE = "PSF-2.0 (Python Software Foundation License Version 2)"
LICENSE_URL = "https://docs.python.org/3/license.html"
#: The standard library's ``Source.name``.
STDLIB = "cpython-stdlib"

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
    # installed distributions whose .py sources join the standard library's (license-checked)
    packages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.packages, str) or not all(isinstance(p, str) for p in self.packages):
            raise InvalidRequestError(f"CorpusSpec.packages={self.packages!r}; allowed: a list of distribution "
                                      'names, e.g. ["numpy", "sympy"]')
        object.__setattr__(self, "packages", tuple(self.packages))  # a JSON list becomes the hashable tuple
        seen: dict[str, str] = {}
        for name in self.packages:
            if not _DIST_NAME.match(name):
                raise InvalidRequestError(f"CorpusSpec.packages: {name!r} is not a distribution name; allowed: "
                                          "letters, digits, '.', '_' and '-', starting and ending with a letter "
                                          "or digit")
            if canonical_name(name) in seen:
                raise InvalidRequestError(f"CorpusSpec.packages: {name!r} repeats {seen[canonical_name(name)]!r}")
            seen[canonical_name(name)] = name
        if self.max_bytes <= 0:
            raise InvalidRequestError(f"CorpusSpec.max_bytes={self.max_bytes}; allowed: a positive integer")
        if self.max_file_bytes <= 0:
            raise InvalidRequestError(f"CorpusSpec.max_file_bytes={self.max_file_bytes}; allowed: a positive integer")
        if not 0 < self.heldout_per_mille < 1000:
            raise InvalidRequestError(f"CorpusSpec.heldout_per_mille={self.heldout_per_mille}; allowed: 1..999")

    def resolved_root(self) -> Path:
        return Path(self.root if self.root is not None else sysconfig.get_paths()["stdlib"])

    def to_dict(self) -> dict:
        """The spec as JSON-able fields. NOTE: without ``packages`` when it is empty, so a stdlib-only spec
        records exactly as it did before the field existed (the shipped model's training_info.json)."""
        d = asdict(self)
        if not self.packages:
            del d["packages"]
        else:
            d["packages"] = list(self.packages)
        return d


_DIST_NAME = re.compile(r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])$")


def canonical_name(name: str) -> str:
    """A distribution name normalised as PEP 503 does (``Jinja2`` -> ``jinja2``, ``typing_extensions`` ->
    ``typing-extensions``): the prefix of its files' corpus paths."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Document:
    """One source file: its corpus path (relative to its source's root, prefixed ``NAME:`` for a
    distribution) and its text (``\\n`` line ends)."""

    path: str
    text: str
    source: str = STDLIB  # the Source.name it comes from


@dataclass(frozen=True)
class Source:
    """Where documents come from: the standard library, or one installed distribution."""

    name: str  # STDLIB or the distribution's canonical name
    version: str  # the Python version for the standard library
    license: str  # what the license metadata says
    root: Path  # the files' paths are relative to it
    prefix: str  # prepended to each relative path to form the corpus path ("" for the standard library)
    files: tuple[str, ...]  # candidate files, relative to root, after the fixed filters


def _path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")


def is_heldout(rel: str, spec: CorpusSpec) -> bool:
    """Whether the file at relative path ``rel`` belongs to the held-out split."""
    return _path_hash(rel) % 1000 < spec.heldout_per_mille


def _excluded(parts: tuple[str, ...]) -> bool:
    return any(part in EXCLUDED_DIRS for part in parts[:-1])


def _stdlib_source(spec: CorpusSpec) -> Source:
    root = spec.resolved_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory (CorpusSpec.root)")
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if _excluded(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        if not p.is_file() or p.stat().st_size > spec.max_file_bytes:
            continue
        files.append(rel.as_posix())
    return Source(STDLIB, platform.python_version(), LICENSE, root, "", tuple(files))


def distribution_source(name: str, spec: CorpusSpec) -> Source:
    """The installed distribution ``name`` as a source: its license checked, its ``.py`` files listed.

    Raises :class:`LicenseRefused` when its license metadata is not on the allow-list and
    ``LookupError`` when it is not installed or lists no usable ``.py`` file.
    """
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise LookupError(f"CorpusSpec.packages: {name!r} is not installed for this interpreter "
                          "(importlib.metadata found no distribution of that name)") from None
    version = dist.version
    verdict = license_verdict(dist.metadata)
    if not verdict.allowed:
        raise LicenseRefused(f"CorpusSpec.packages: {name!r} {version} is not on the license allow-list: its "
                             f"metadata says {verdict.found}; allowed: {ALLOWED_SUMMARY}")
    root = Path(dist.locate_file(""))
    files = _usable(dist.files or (), root, spec)
    if not files:
        # no file list (a distro package's egg-info keeps no RECORD) or none of it found: its top-level packages
        files = _usable(_top_level_files(dist, root), root, spec)
    if not files:
        raise LookupError(f"CorpusSpec.packages: {name!r} {version} has no .py file under {root}, neither in its "
                          "file list (RECORD) nor in its top-level packages (top_level.txt): an editable or "
                          "non-Python install?")
    return Source(canonical_name(name), version, verdict.found, root, canonical_name(name) + ":", tuple(files))


def _usable(listed, root: Path, spec: CorpusSpec) -> list[str]:
    """The ``.py`` files of a distribution's file list that pass the corpus's filters, as POSIX paths."""
    files = []
    for f in listed:
        f = PurePosixPath(*PurePath(f).parts)
        # NOTE: RECORD may list files outside the package directory (scripts under ../../bin): never read them
        if f.suffix != ".py" or ".." in f.parts or f.parts[0].endswith((".dist-info", ".egg-info")) or _excluded(f.parts):
            continue
        p = root / f
        if not p.is_file() or p.stat().st_size > spec.max_file_bytes:
            continue
        files.append(f.as_posix())
    return files


def _top_level_files(dist: importlib.metadata.Distribution, root: Path) -> list[PurePosixPath]:
    """Every ``.py`` file of the import packages and modules ``top_level.txt`` names, relative to ``root``."""
    out: list[PurePosixPath] = []
    for top in sorted(set((dist.read_text("top_level.txt") or "").split())):
        if (root / top).is_dir():
            out += [PurePosixPath(p.relative_to(root).as_posix()) for p in (root / top).rglob("*.py")]
        elif (root / f"{top}.py").is_file():
            out.append(PurePosixPath(f"{top}.py"))
    return out


def sources(spec: CorpusSpec) -> list[Source]:
    """The standard library, then each of ``spec.packages`` in the spec's order."""
    return [_stdlib_source(spec), *(distribution_source(name, spec) for name in spec.packages)]


def _candidates(srcs: list[Source]) -> list[tuple[str, Source, str]]:
    """``(corpus path, source, relative path)`` of every candidate file, in the corpus's fixed order."""
    out = [(src.prefix + rel, src, rel) for src in srcs for rel in src.files]
    # NOTE: order by path hash (ties impossible: distinct paths), never by rglob's or RECORD's order.
    return sorted(out, key=lambda c: (_path_hash(c[0]), c[0]))


def documents(spec: CorpusSpec = CorpusSpec(), srcs: list[Source] | None = None) -> list[Document]:
    """Every document of the corpus (both splits) in its fixed order, within the byte budget."""
    docs, total = [], 0
    for path, src, rel in _candidates(sources(spec) if srcs is None else srcs):
        try:
            text = (src.root / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a few legacy files are not UTF-8; a fixed rule, so still deterministic
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        size = len(text.encode("utf-8"))
        if total + size > spec.max_bytes:
            break
        docs.append(Document(path, text, src.name))
        total += size
    return docs


def split(spec: CorpusSpec = CorpusSpec()) -> tuple[list[Document], list[Document]]:
    """``(train, heldout)`` documents; training never reads the held-out files."""
    return _split_docs(documents(spec), spec)


def _split_docs(docs: list[Document], spec: CorpusSpec) -> tuple[list[Document], list[Document]]:
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
    # per source (the standard library first, then spec.packages): name, version, license, root, files,
    # bytes and the held-out part of both
    sources: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _nbytes(docs: list[Document]) -> int:
    return sum(len(d.text.encode("utf-8")) for d in docs)


def corpus_info(spec: CorpusSpec = CorpusSpec()) -> CorpusInfo:
    """Name, license, versions, sizes and digest of the corpus ``spec`` selects on this interpreter."""
    srcs = sources(spec)
    docs = documents(spec, srcs)
    train, heldout = _split_docs(docs, spec)
    digest = hashlib.sha256()
    for d in docs:
        digest.update(d.path.encode("utf-8") + b"\0" + d.text.encode("utf-8") + b"\0")
    version = platform.python_version()
    name = f"CPython {version} standard library (Lib/*.py without tests, site-packages and encodings)"
    license_text = LICENSE
    if spec.packages:
        name += " and the .py sources (without tests) of " + ", ".join(f"{s.name} {s.version}" for s in srcs[1:])
        license_text += "; each package under its own license (sources)"
    per_source = []
    for src in srcs:
        mine = [d for d in docs if d.source == src.name]
        held = [d for d in mine if is_heldout(d.path, spec)]
        per_source.append({"name": src.name, "version": src.version, "license": src.license, "root": str(src.root),
                           "files": len(mine), "bytes": _nbytes(mine), "heldout_files": len(held),
                           "heldout_bytes": _nbytes(held)})
    return CorpusInfo(
        name=name, license=license_text, license_url=LICENSE_URL, python_version=version,
        implementation=platform.python_implementation(), root=str(spec.resolved_root()),
        train_files=len(train), train_bytes=_nbytes(train), heldout_files=len(heldout), heldout_bytes=_nbytes(heldout),
        sha256=digest.hexdigest(), spec=spec.to_dict(), sources=per_source,
    )
