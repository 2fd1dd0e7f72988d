"""The corpus's fixed rules on a hand-made Lib/ tree, and the tokenizer's ids, files and determinism."""
from __future__ import annotations

import platform

import pytest

from loopline.models.loader import load_tokenizer
from loopline.train.corpus import CorpusSpec, corpus_info, documents, is_heldout, split
from loopline.train.tokenizer import encode_documents, train_tokenizer, write_tokenizer


@pytest.fixture
def lib(tmp_path):
    files = {
        "a.py": "x = 1\r\n", "pkg/b.py": "def f():\n    return 2\n", "pkg/c.py": "# " + "c" * 300 + "\n",
        "test/test_a.py": "assert True\n", "site-packages/dep.py": "third party\n", "encodings/cp1.py": "table\n",
        "pkg/__pycache__/x.py": "cached\n", "notes.txt": "not python\n", "big.py": "#" * 5000 + "\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, newline="")
    (tmp_path / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped by rule
    return tmp_path


def test_filters_order_and_budget(lib):
    spec = CorpusSpec(root=str(lib), max_file_bytes=1000, heldout_per_mille=500)
    docs = documents(spec)
    assert sorted(d.path for d in docs) == ["a.py", "pkg/b.py", "pkg/c.py"]
    assert next(d for d in docs if d.path == "a.py").text == "x = 1\n"  # line ends normalised
    assert [d.path for d in documents(spec)] == [d.path for d in docs]  # the same order every time
    # the budget stops at the first file that does not fit, in that fixed order
    first = docs[0]
    small = CorpusSpec(root=str(lib), max_file_bytes=1000, max_bytes=len(first.text.encode()))
    assert [d.path for d in documents(small)] == [first.path]
    train, heldout = split(spec)
    assert {d.path for d in heldout} == {d.path for d in docs if is_heldout(d.path, spec)}
    assert not {d.path for d in train} & {d.path for d in heldout}
    info = corpus_info(spec)
    assert info.python_version == platform.python_version() and info.license.startswith("PSF-2.0")
    assert info.train_files + info.heldout_files == 3 and info.sha256 == corpus_info(spec).sha256
    assert corpus_info(CorpusSpec(root=str(lib), max_file_bytes=1000, max_bytes=10)).sha256 != info.sha256


def test_missing_root_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="CorpusSpec.root"):
        documents(CorpusSpec(root=str(tmp_path / "nope")))


def test_tokenizer_keeps_ouro_ids_is_deterministic_and_loads(tmp_path):
    texts = ["def add(a, b):\n    return a + b\n" * 20, "class Point:\n    x: int = 0\n" * 20]
    tok = train_tokenizer(texts, 300)
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert train_tokenizer(texts, 300).to_str() == tok.to_str()
    odd = "naïve 12345 \t\x00 ünïcode ✓"
    assert tok.decode(tok.encode(odd).ids) == odd  # byte-level: nothing is unknown
    assert tok.encode("12").ids == [tok.token_to_id("1"), tok.token_to_id("2")]
    stream = encode_documents(tok, ["ab", "cd"])
    assert stream.count(0) == 2 and stream[-1] == 0
    write_tokenizer(tok, tmp_path, 256)
    hf = load_tokenizer(tmp_path)
    assert hf.encode("def add(", add_special_tokens=False) == tok.encode("def add(").ids
    assert "<|im_start|>assistant\n" in hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                              add_generation_prompt=True)
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_tokenizer(texts, 100)
