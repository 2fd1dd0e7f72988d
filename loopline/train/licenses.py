"""Which installed distributions' sources may join the training corpus: a license allow-list.

A distribution is accepted only when its metadata shows a license that permits distributing a model
trained on its text (the permissive family: PSF, BSD, MIT, Apache-2.0 and a few equivalents that
large packages vendor files under). The metadata is read in the order packaging defines it:

1. ``License-Expression`` (PEP 639), when present, decides alone: an SPDX expression whose ``AND``
   terms must all be allowed (one allowed alternative suffices for ``OR``).
2. Otherwise every ``License :: ...`` classifier and the free-text ``License`` field are evidence:
   each classifier and a ``License`` field that names a license (a usual spelling such as
   ``"Apache 2.0 License"``, or an SPDX expression) must be allowed, and at least one must be there.
   A ``License`` field holding a whole license text counts by its title line when that is a usual
   name (``"MIT License"``); one holding an unrecognised text or nothing useful (``UNKNOWN``) is not
   evidence either way.

Anything else -- a copyleft license, an unknown name, no license metadata at all -- is refused with
an error naming the distribution and what its metadata says.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from email.message import Message

#: SPDX identifiers allowed (compared case-insensitively, as SPDX specifies). The last row are permissive
#: licenses of files vendored by numpy and torch (their License-Expression lists them); each allows
#: redistribution of derived works with at most an attribution, like BSD/MIT.
ALLOWED_SPDX = frozenset({
    "PSF-2.0", "Python-2.0",
    "BSD-2-Clause", "BSD-3-Clause", "0BSD",
    "MIT", "MIT-0",
    "Apache-2.0",
    "ISC", "Zlib", "BSL-1.0", "CC0-1.0",
})
#: SPDX exceptions that only add permissions (``Apache-2.0 WITH LLVM-exception`` in torch's metadata).
ALLOWED_EXCEPTIONS = frozenset({"LLVM-exception"})

#: Usual free-text spellings of the ``License`` field, after :func:`_normalise`, and their SPDX id.
SPELLINGS: dict[str, str] = {
    "psf": "PSF-2.0", "psfl": "PSF-2.0", "psf 2.0": "PSF-2.0", "python software foundation": "PSF-2.0",
    "bsd": "BSD-3-Clause", "new bsd": "BSD-3-Clause", "modified bsd": "BSD-3-Clause", "revised bsd": "BSD-3-Clause",
    "bsd 3 clause": "BSD-3-Clause", "3 clause bsd": "BSD-3-Clause", "bsd 2 clause": "BSD-2-Clause",
    "2 clause bsd": "BSD-2-Clause", "simplified bsd": "BSD-2-Clause",
    "mit": "MIT", "expat": "MIT", "mit expat": "MIT",
    "apache": "Apache-2.0", "apache 2": "Apache-2.0", "apache 2.0": "Apache-2.0", "apache software": "Apache-2.0",
    "apache software 2.0": "Apache-2.0", "asl 2.0": "Apache-2.0",
    "isc": "ISC",
}

#: ``License ::`` classifiers allowed (Trove names of the licenses above).
ALLOWED_CLASSIFIERS = frozenset({
    "License :: OSI Approved :: Python Software Foundation License",
    "License :: OSI Approved :: BSD License",
    "License :: OSI Approved :: MIT License",
    "License :: OSI Approved :: MIT No Attribution License (MIT-0)",
    "License :: OSI Approved :: Apache Software License",
    "License :: OSI Approved :: ISC License (ISCL)",
    "License :: OSI Approved :: zlib/libpng License",
    "License :: OSI Approved :: Boost Software License 1.0 (BSL-1.0)",
    "License :: CC0 1.0 Universal (CC0 1.0) Public Domain Dedication",
})
#: Classifiers that name no license (a category, not evidence either way).
GENERIC_CLASSIFIERS = frozenset({"License :: OSI Approved", "License :: DFSG approved"})

ALLOWED_SUMMARY = "PSF, BSD, MIT, Apache-2.0 (and ISC, Zlib, BSL-1.0, CC0-1.0, 0BSD, MIT-0)"


class LicenseRefused(ValueError):
    """A distribution whose license metadata is not on the allow-list (or is missing)."""


@dataclass(frozen=True)
class LicenseVerdict:
    """What the metadata says (``found``, for the record and the error) and whether it is allowed."""

    allowed: bool
    found: str


class _NotSpdx(ValueError):
    pass


def _licensing():
    """The SPDX license list of ``license-expression`` (optional extra ``loopline[train]``)."""
    try:
        from license_expression import get_spdx_licensing
    except ImportError as e:
        raise ImportError("reading SPDX license expressions of corpus packages needs the license-expression "
                          "package: pip install 'loopline[train]'") from e
    global _LICENSING
    if _LICENSING is None:
        _LICENSING = get_spdx_licensing()
    return _LICENSING


_LICENSING = None


def spdx_allowed(expression: str) -> bool:
    """Whether the SPDX license ``expression`` is satisfied by :data:`ALLOWED_SPDX`.

    ``AND`` needs every term allowed, ``OR`` one alternative, ``X WITH E`` needs ``X`` allowed and
    ``E`` in :data:`ALLOWED_EXCEPTIONS`. ``X+`` ("or later") reads as ``X-or-later``, which is not on the
    list. Raises ``ValueError`` when ``expression`` is not an SPDX expression of known identifiers.
    """
    import boolean
    from license_expression import LicenseSymbol, LicenseWithExceptionSymbol

    try:
        parsed = _licensing().parse(expression, validate=True, strict=True)
    except Exception as e:  # the library's ExpressionError / ParseError: not SPDX, or unknown identifiers
        raise _NotSpdx(expression) from e
    if parsed is None:
        raise _NotSpdx(expression)
    allowed = {s.lower() for s in ALLOWED_SPDX}
    exceptions = {s.lower() for s in ALLOWED_EXCEPTIONS}

    def holds(node) -> bool:
        if isinstance(node, LicenseWithExceptionSymbol):
            return holds(node.license_symbol) and node.exception_symbol.key.lower() in exceptions
        if isinstance(node, LicenseSymbol):
            return node.key.lower() in allowed
        if isinstance(node, boolean.AND):
            return all(holds(a) for a in node.args)
        if isinstance(node, boolean.OR):
            return any(holds(a) for a in node.args)
        raise _NotSpdx(expression)

    return holds(parsed)


def _normalise(text: str) -> str:
    words = re.sub(r"[^a-z0-9.]+", " ", text.lower()).replace(" .", " ").split()
    out: list[str] = []
    for w in words:
        w = w.strip(".")
        if w and w not in ("the", "license", "licence", "licensed", "version", "v", "under") and w not in out:
            out.append(w)
    return " ".join(out)


def _license_field_verdict(text: str) -> LicenseVerdict | None:
    """The ``License`` field's verdict, or None when it names no license (empty, UNKNOWN, an unrecognised text)."""
    text = text.strip()
    if "\n" in text:
        # a whole license text: its title line counts when it is a usual name ("MIT License\n\nCopyright ...")
        title = text.splitlines()[0].strip()
        return LicenseVerdict(True, title) if _normalise(title) in SPELLINGS else None
    if not text or text.upper() in ("UNKNOWN", "NONE"):
        return None
    if _normalise(text) in SPELLINGS:
        return LicenseVerdict(True, text)
    try:
        return LicenseVerdict(spdx_allowed(text), text)
    except _NotSpdx:
        return None  # free text that names nothing we recognise: not evidence


def license_verdict(metadata: Message) -> LicenseVerdict:
    """The allow-list's verdict on a distribution's core metadata (``importlib.metadata``'s ``metadata``)."""
    expression = (metadata.get("License-Expression") or "").strip()
    if expression:
        try:
            return LicenseVerdict(spdx_allowed(expression), f"License-Expression: {expression}")
        except _NotSpdx:
            return LicenseVerdict(False, f"License-Expression: {expression} (not an SPDX expression)")
    evidence: list[LicenseVerdict] = []
    field = _license_field_verdict(metadata.get("License") or "")
    if field is not None:
        evidence.append(LicenseVerdict(field.allowed, f"License: {field.found}"))
    for c in metadata.get_all("Classifier") or []:
        if c.startswith("License ::") and c not in GENERIC_CLASSIFIERS:
            evidence.append(LicenseVerdict(c in ALLOWED_CLASSIFIERS, c.split(" :: ")[-1] + " (classifier)"))
    if not evidence:
        raw = (metadata.get("License") or "").strip().splitlines()
        shown = f"License: {raw[0][:60]!r}{' ...' if len(raw) > 1 else ''}" if raw else "no License field"
        return LicenseVerdict(False, f"no recognised license ({shown}, no License-Expression, no license classifier)")
    return LicenseVerdict(all(e.allowed for e in evidence), "; ".join(e.found for e in evidence))
