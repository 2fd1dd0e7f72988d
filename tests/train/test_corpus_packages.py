"""CorpusSpec.packages: the license allow-list, installed distributions as sources (fake ones on sys.path
and the real ones of ``demo-large``), the split's stability, the recorded sources, and old specs unchanged."""
from __future__ import annotations

import importlib
from email.message import Message
from pathlib import Path

import pytest

from loopline.train.presets import DEMO_LARGE_PACKAGES, PRESETS, build_config
from loopline.train.corpus import (STDLIB, CorpusSpec, canonical_name, corpus_info, distribution_source, documents,
                                   is_heldout, split)
from loopline.train.licenses import LicenseRefused, license_verdict, spdx_allowed
from loopline.train.model_card import render_model_card
from loopline.train.trainer import TrainConfig

from train.conftest import installed

# --- the allow-list on hand-made metadata ------------------------------------------------------------


def meta(license: str | None = None, expression: str | None = None, classifiers: tuple[str, ...] = ()) -> Message:
    m = Message()
    m["Name"], m["Version"] = "x", "1.0"
    if license is not None:
        m["License"] = license
    if expression is not None:
        m["License-Expression"] = expression
    for c in classifiers:
        m["Classifier"] = c
    return m


BSD_CLS = "License :: OSI Approved :: BSD License"
GPL_CLS = "License :: OSI Approved :: GNU General Public License v3 (GPLv3)"


@pytest.mark.parametrize("expression", [
    "MIT", "mit", "Apache-2.0 OR BSD-2-Clause", "PSF-2.0", "(MIT OR GPL-3.0-only) AND BSD-3-Clause",
    "Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSD-2-Clause AND BSD-3-Clause AND BSL-1.0 AND MIT",  # torch
    "BSD-3-Clause AND 0BSD AND MIT AND Zlib AND CC0-1.0",  # numpy
])
def test_spdx_expressions_accepted(expression):
    assert spdx_allowed(expression)
    assert license_verdict(meta(expression=expression)).allowed


@pytest.mark.parametrize("expression", [
    "GPL-3.0-or-later", "MPL-2.0 AND MIT", "Apache-2.0 AND CNRI-Python", "MIT-CMU",
    "Apache-2.0 WITH Classpath-exception-2.0", "(MIT AND LGPL-2.1-only) OR GPL-2.0-only",
])
def test_spdx_expressions_refused(expression):
    assert not spdx_allowed(expression)
    verdict = license_verdict(meta(expression=expression))
    assert not verdict.allowed and expression in verdict.found


@pytest.mark.parametrize("expression", ["LicenseRef-Proprietary", "MIT+"])
def test_unknown_spdx_identifiers_are_refused(expression):
    """Identifiers outside the SPDX list (a private LicenseRef, "or later" of a license that has none)."""
    with pytest.raises(ValueError):
        spdx_allowed(expression)
    verdict = license_verdict(meta(expression=expression))
    assert not verdict.allowed and expression in verdict.found


@pytest.mark.parametrize("text", ["MIT and", "(MIT", "MIT)", "Apache 2.0 License", "", "AND MIT"])
def test_spdx_syntax_errors_raise(text):
    with pytest.raises(ValueError):
        spdx_allowed(text)


def test_the_expression_decides_alone():
    assert not license_verdict(meta(expression="GPL-3.0-only", classifiers=(BSD_CLS,), license="MIT")).allowed
    assert license_verdict(meta(expression="MIT", classifiers=(GPL_CLS,))).allowed
    bad = license_verdict(meta(expression="MIT and and"))
    assert not bad.allowed and "not an SPDX expression" in bad.found


@pytest.mark.parametrize("text", [
    "BSD", "BSD License", "new BSD", "3-Clause BSD License", "MIT", "MIT License", "Apache 2.0", "Apache 2.0 License",
    "Apache License, Version 2.0", "Apache Software License", "PSFL", "Python Software Foundation License",
    "MIT OR Apache-2.0", "BSD-3-Clause", "MIT License\n\nCopyright (c) someone\n\nPermission is hereby granted ...",
])
def test_usual_license_field_spellings_accepted(text):
    verdict = license_verdict(meta(license=text))
    assert verdict.allowed, verdict


@pytest.mark.parametrize("text", ["GPLv3", "MPL-2.0 AND MIT", "Proprietary", "LGPL-2.1-or-later"])
def test_other_license_fields_refused(text):
    verdict = license_verdict(meta(license=text))
    assert not verdict.allowed and text in verdict.found


def test_classifiers_and_fields_together():
    assert license_verdict(meta(classifiers=(BSD_CLS,))).allowed
    assert license_verdict(meta(license="UNKNOWN", classifiers=(BSD_CLS, "License :: OSI Approved"))).allowed
    # a whole license text without a usual title names nothing: the classifier decides
    assert license_verdict(meta(license="Copyright (c) 2001 Someone\nRedistribution and use ...",
                                classifiers=(BSD_CLS,))).allowed
    # every piece of evidence must be allowed
    assert not license_verdict(meta(license="MIT", classifiers=(GPL_CLS,))).allowed
    assert not license_verdict(meta(license="BSD", classifiers=(BSD_CLS, GPL_CLS))).allowed
    for m in (meta(), meta(license="UNKNOWN"), meta(license="Copyright (c) 2001 Someone\nAll rights reserved."),
              meta(classifiers=("License :: OSI Approved",))):
        verdict = license_verdict(m)
        assert not verdict.allowed and "no recognised license" in verdict.found


# --- fake distributions on sys.path ------------------------------------------------------------------


def lay_out(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, newline="")


def fake_dist(site: Path, name: str, version: str, metadata: str, files: dict[str, str], extra_record=()) -> None:
    """A wheel-installed distribution: its files under ``site`` and a dist-info whose RECORD lists them."""
    lay_out(site, files)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n{metadata}\n")
    rows = [*files, *extra_record, f"{info.name}/METADATA", f"{info.name}/RECORD"]
    (info / "RECORD").write_text("".join(f"{r},,\n" for r in rows))


@pytest.fixture
def lib(tmp_path):
    """A small Lib/ tree (the standard-library part)."""
    root = tmp_path / "Lib"
    lay_out(root, {"a.py": "x = 1\r\n", "test/test_a.py": "assert True\n", "json/decoder.py": "def decode(s):\n    pass\n",
                   **{f"mod{i}/m{i}.py": f"def g{i}(a):\n    return a * {i}\n" for i in range(30)}})
    return root


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    fake_dist(site, "Good_Pkg", "1.2", "License-Expression: MIT", {
        **{f"good_pkg/sub{i}.py": f"class C{i}:\n    '''Doc {i}.'''\n" for i in range(30)},
        "good_pkg/__init__.py": "from .sub0 import C0\n",
        "good_pkg/tests/test_core.py": "def test(): pass\n", "good_pkg/data.txt": "not python\n",
        "good_pkg/huge.py": "#" * 3000 + "\n", "json/decoder.py": "# the package's own json/decoder.py\n",
    }, extra_record=("../bin/tool.py",))
    (site.parent / "bin").mkdir()
    (site.parent / "bin" / "tool.py").write_text("print('a script outside site-packages')\n")
    fake_dist(site, "copyleft", "0.1", "License-Expression: GPL-3.0-or-later", {"copyleft/__init__.py": "x = 1\n"})
    fake_dist(site, "vague", "0.2", "License: see LICENSE file\nClassifier: License :: OSI Approved",
              {"vague/__init__.py": "x = 1\n"})
    fake_dist(site, "empty_pkg", "3.0", "License: MIT", {"empty_pkg/README.txt": "no python\n"})
    # a distro package's egg-info: no file list, only the top-level packages
    lay_out(site, {"legacy_pkg/__init__.py": "A = 1\n", "legacy_pkg/util/io.py": "def read(): pass\n",
                   "legacy_pkg/tests/test_a.py": "def test(): pass\n", "legacy_mod.py": "B = 2\n"})
    lay_out(site / "legacy_pkg-2.0.egg-info", {"PKG-INFO": "Metadata-Version: 1.2\nName: legacy-pkg\nVersion: 2.0\n"
                                                           "License: BSD\n", "top_level.txt": "legacy_pkg\nlegacy_mod\n"})
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site


def test_a_distributions_files_join_under_its_prefixed_paths(lib, site):
    spec = CorpusSpec(root=str(lib), max_file_bytes=1000, heldout_per_mille=300, packages=("Good_Pkg",))
    docs = documents(spec)
    pkg = sorted(d.path for d in docs if d.source == "good-pkg")
    # tests/, non-.py, oversized and outside-the-site files are left out, as for the standard library
    assert pkg == sorted(["good-pkg:good_pkg/__init__.py", "good-pkg:json/decoder.py",
                          *(f"good-pkg:good_pkg/sub{i}.py" for i in range(30))])
    assert next(d for d in docs if d.path == "good-pkg:json/decoder.py").text.startswith("# the package's own")
    assert next(d for d in docs if d.path == "json/decoder.py").source == STDLIB  # no collision with Lib/json
    assert canonical_name("Good_Pkg") == canonical_name("good.pkg") == "good-pkg"
    # the one fixed order mixes the sources (by path hash), so the byte budget cuts across them
    order = [d.source for d in docs]
    assert order != sorted(order, key=lambda s: s != STDLIB)
    assert CorpusSpec(root=str(lib), packages=["good-pkg"]).packages == ("good-pkg",)  # JSON lists are accepted


def test_a_distribution_without_a_file_list_gives_its_top_level_packages(lib, site):
    docs = documents(CorpusSpec(root=str(lib), packages=("legacy-pkg",)))
    assert sorted(d.path for d in docs if d.source == "legacy-pkg") == [
        "legacy-pkg:legacy_mod.py", "legacy-pkg:legacy_pkg/__init__.py", "legacy-pkg:legacy_pkg/util/io.py"]


def test_adding_a_package_never_moves_a_files_split(lib, site):
    base = CorpusSpec(root=str(lib), max_file_bytes=1000, heldout_per_mille=300)
    more = CorpusSpec(root=str(lib), max_file_bytes=1000, heldout_per_mille=300, packages=("good-pkg",))
    train0, held0 = split(base)
    train1, held1 = split(more)
    assert held0 and train0  # both splits have standard-library files at this rate
    std = lambda docs: {d.path for d in docs if d.source == STDLIB}  # noqa: E731
    assert std(train1) == {d.path for d in train0} and std(held1) == {d.path for d in held0}
    assert {d.path for d in held1} == {d.path for d in documents(more) if is_heldout(d.path, more)}
    assert any(d.source == "good-pkg" for d in held1) and any(d.source == "good-pkg" for d in train1)
    # with a budget that binds, every file kept is still on the side its path says
    tight = CorpusSpec(root=str(lib), max_file_bytes=1000, heldout_per_mille=300, max_bytes=700, packages=("good-pkg",))
    t, h = split(tight)
    assert sum(len(d.text.encode()) for d in t + h) <= 700
    assert {d.path for d in h} <= {d.path for d in held1} and {d.path for d in t} <= {d.path for d in train1}


def test_corpus_info_records_every_source(lib, site):
    spec = CorpusSpec(root=str(lib), max_file_bytes=1000, heldout_per_mille=300, packages=("good-pkg",))
    info = corpus_info(spec)
    assert [s["name"] for s in info.sources] == [STDLIB, "good-pkg"]
    std, pkg = info.sources
    assert pkg["version"] == "1.2" and pkg["license"] == "License-Expression: MIT" and pkg["root"] == str(site)
    assert pkg["files"] == 32 and std["files"] == 32 and std["license"].startswith("PSF-2.0")
    assert std["files"] + pkg["files"] == info.train_files + info.heldout_files
    assert std["bytes"] + pkg["bytes"] == info.train_bytes + info.heldout_bytes
    assert std["heldout_bytes"] + pkg["heldout_bytes"] == info.heldout_bytes
    assert "good-pkg 1.2" in info.name and info.spec["packages"] == ["good-pkg"]
    assert info.sha256 != corpus_info(CorpusSpec(root=str(lib), max_file_bytes=1000, heldout_per_mille=300)).sha256
    # the model card's table shows each of them, and its engine section names the packages' held-out files
    point = {"threshold": 1.0, "mean_depth": 4.0, "loss": 3.0, "tokens": 8, "depth_histogram": {"4": 8}}
    curve = {"engine": [point], "device": "cpu", "python_version": "3.x", "kv_layout": "shared",
             "max_abs_loss_diff": 0.0, "depths_equal": True}
    card = render_model_card({"corpus": {**info.to_dict(), "train_tokens": 10, "heldout_tokens": 2},
                              "train_config": TrainConfig().to_dict(), "parameters": 1, "step": 0,
                              "early_exit_threshold": 1.0}, curve)
    assert "| good-pkg | 1.2 | License-Expression: MIT | 32 |" in card and f"| {STDLIB} |" in card
    assert "the held-out files of CPython 3.x and the packages" in card


def test_refused_missing_and_malformed_packages_are_named(lib, site):
    def build(*packages):
        return documents(CorpusSpec(root=str(lib), packages=packages))

    with pytest.raises(LicenseRefused, match=r"'copyleft' 0.1 .*GPL-3.0-or-later.*allowed: PSF, BSD, MIT, Apache-2.0"):
        build("good-pkg", "copyleft")
    with pytest.raises(LicenseRefused, match=r"'vague' 0.2 .*no recognised license"):
        build("vague")
    with pytest.raises(LookupError, match=r"'no-such-dist' is not installed"):
        build("no-such-dist")
    with pytest.raises(LookupError, match=r"'empty_pkg' 3.0 has no .py file"):
        build("empty_pkg")
    with pytest.raises(ValueError, match=r"CorpusSpec.packages='numpy'; allowed: a list"):
        CorpusSpec(packages="numpy")
    with pytest.raises(ValueError, match=r"'Good.Pkg' repeats 'good-pkg'"):
        CorpusSpec(packages=("good-pkg", "Good.Pkg"))
    with pytest.raises(ValueError, match=r"'../x' is not a distribution name"):
        CorpusSpec(packages=("../x",))


# --- old specs --------------------------------------------------------------------------------------


def test_a_spec_without_packages_gives_the_corpus_it_gave_before(tmp_path):
    """Digests and sizes computed by the corpus code before ``packages`` existed (commit 5fbbe9e), on a fixed tree."""
    files = {
        "a.py": "x = 1\r\n", "pkg/b.py": "def f():\n    return 2\n", "pkg/c.py": "# " + "c" * 300 + "\n",
        "test/test_a.py": "assert True\n", "site-packages/dep.py": "third party\n", "encodings/cp1.py": "table\n",
        "pkg/__pycache__/x.py": "cached\n", "notes.txt": "not python\n", "big.py": "#" * 5000 + "\n",
        **{f"mod{i}/m{i}.py": f"def g{i}(a):\n    return a * {i}\n" for i in range(40)},
    }
    lay_out(tmp_path, files)
    (tmp_path / "latin.py").write_bytes(b"s = '\xe9'\n")
    for max_bytes, expected in ((16_000_000, ("543ca1ce81967b80e366d7ed6d7faa22aba086e64102af3c4ee30ea8447afa76", 37, 1357, 6, 154)),
                                (600, ("93ffed90abb0f51af55e3de7f1cb1d00d9775162d4d27299b7b13d40d9172531", 16, 460, 0, 0))):
        info = corpus_info(CorpusSpec(root=str(tmp_path), max_file_bytes=1000, heldout_per_mille=200, max_bytes=max_bytes))
        assert (info.sha256, info.train_files, info.train_bytes, info.heldout_files, info.heldout_bytes) == expected
        assert "packages" not in info.spec and len(info.sources) == 1 and info.sources[0]["name"] == STDLIB
    # a stdlib-only config records as before the field existed (the shipped model's training_info.json)
    assert "packages" not in TrainConfig().to_dict()["corpus"]
    assert TrainConfig.from_dict(TrainConfig().to_dict()) == TrainConfig()


# --- demo-large's real packages, on small budgets ----------------------------------------------------


def test_demo_large_packages_are_accepted_here():
    """loopline's own dependencies are always installed; the rest of the preset's list is checked where present."""
    present = [p for p in DEMO_LARGE_PACKAGES if installed(p)]
    assert {"torch", "transformers", "numpy", "jinja2"} <= set(present)
    spec = CorpusSpec()
    for name in present:
        src = distribution_source(name, spec)
        assert src.prefix == canonical_name(name) + ":" and src.files
        assert not any("/tests/" in f"/{f}" or "/test/" in f"/{f}" for f in src.files)


def test_demo_large_preset_on_a_small_budget():
    present = [p for p in DEMO_LARGE_PACKAGES if installed(p)]
    config = build_config("demo-large", None, ["corpus.max_bytes=400000", f"corpus.packages={present!r}".replace("'", '"')])
    assert config.model == TrainConfig().model and config.seq_len == 512 and config.batch_size == 32
    info = corpus_info(config.corpus)
    assert [s["name"] for s in info.sources] == [STDLIB, *map(canonical_name, present)]
    assert info.train_bytes + info.heldout_bytes <= 400_000
    assert sum(s["files"] for s in info.sources[1:]) > 0  # packages and stdlib files mix in the one order
    # the preset itself: the demo's schedule stretched, the budget over the selection, demo untouched
    preset = PRESETS["demo-large"]
    assert tuple(preset["corpus"]["packages"]) == DEMO_LARGE_PACKAGES and PRESETS["demo"] == {}
    full = build_config("demo-large", None, [])
    demo = TrainConfig()
    assert full.stage1_steps > 4 * demo.stage1_steps and full.lr == demo.lr
    assert full.warmup_steps / full.stage1_steps == pytest.approx(demo.warmup_steps / demo.stage1_steps, rel=0.01)
