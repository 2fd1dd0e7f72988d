"""A tiny training run's config and data, built once per session (the tokenizer and streams take ~2 s)."""
from __future__ import annotations

import importlib.metadata

import pytest

from loopline.train.corpus import CorpusSpec
from loopline.train.trainer import ModelShape, TrainConfig, build_data

# ~100 KB of corpus, 20% of files held out: at 60 KB the held-out split was empty where a distribution
# ships the standard library without lib2to3 (Ubuntu's CPython 3.12) and on CPython 3.13.
SMOKE = TrainConfig(
    model=ModelShape(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
    corpus=CorpusSpec(max_bytes=120_000, heldout_per_mille=200), seq_len=64, batch_size=8, stage1_steps=30,
    stage2_steps=20, lr=1e-2, warmup_steps=5, stage2_lr=3e-2, stage2_warmup_steps=2, eval_batches=2,
)


@pytest.fixture(scope="session")
def smoke_data():
    return build_data(SMOKE)


def installed(name: str) -> bool:
    """Whether the distribution ``name`` is installed here (the demo-large tests use the packages present)."""
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="module")
def memoized_corpus():
    """Within a module: each corpus of the running interpreter (``CorpusSpec.root`` None) is read once. Reading
    one scans the standard library and the installed packages (~4 s on a busy 2-core machine), and the
    modules that use this build the same corpora many times over (``split_stream`` per split, ``build_data``
    per training run: ``corpus_info`` and ``split`` each). Each caller gets a list of its own (the documents are
    frozen); the corpus tests, which check that reading twice gives the same, do not use this."""
    from loopline.train import corpus

    read = corpus.documents
    cache: dict[CorpusSpec, list] = {}

    def documents(spec: CorpusSpec = CorpusSpec(), srcs=None):
        if srcs is not None or spec.root is not None:
            return read(spec, srcs)
        if spec not in cache:
            cache[spec] = read(spec)
        return list(cache[spec])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "documents", documents)
        yield
