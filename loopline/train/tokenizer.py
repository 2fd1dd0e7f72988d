"""Byte-level BPE for the demo model, trained on the corpus's training split.

The same pre-tokenisation and special tokens as :mod:`loopline.models.tiny`
(``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2, as in Ouro)
and the same three files (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``, ChatML template), so
:func:`loopline.models.loader.load_tokenizer` reads the result unchanged.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from loopline.errors import InvalidRequestError
from loopline.models.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS

MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the specials


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A ``tokenizers.Tokenizer`` (byte-level BPE, digits split) of ``vocab_size`` entries trained on ``texts``.

    Deterministic for the same texts: the BPE trainer counts exactly and breaks ties by the pair.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB:
        raise InvalidRequestError(f"vocab_size={vocab_size}; allowed: >= {MIN_VOCAB} "
                                  f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tokenizer = Tokenizer(models.BPE())
    # Single digits keep numbers compositional; ByteLevel makes every byte sequence encodable (no unk).
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, (token, tokenizer.token_to_id(token))
    return tokenizer


def write_tokenizer(tokenizer, path: str | Path, model_max_length: int) -> None:
    """Writes the tokenizer files of a checkpoint directory (the layout ``tiny.py`` writes)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    eot = SPECIAL_TOKENS[0]
    # As upstream Ouro: bos = eos = pad = <|endoftext|>; a chat turn ends at <|im_end|>.
    specials = {"bos_token": eot, "eos_token": eot, "pad_token": eot, "unk_token": eot,
                "additional_special_tokens": list(SPECIAL_TOKENS[1:])}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "model_max_length": model_max_length,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", specials)):
        (path / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_trained(path: str | Path):
    """The ``tokenizers.Tokenizer`` of a directory written by :func:`write_tokenizer`."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def encode_documents(tokenizer, texts: Iterable[str]) -> list[int]:
    """One token stream: each document's ids followed by ``<|endoftext|>`` (id 0), the separator packing relies on."""
    eot = tokenizer.token_to_id(SPECIAL_TOKENS[0])
    stream: list[int] = []
    for enc in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        stream.extend(enc.ids)
        stream.append(eot)
    return stream
