"""Tiny, deterministic Ouro checkpoints for tests and demos, and real-shape configs.

:func:`make_tiny_checkpoint` writes a complete Hugging Face-style directory
(``config.json``, ``generation_config.json``, safetensors weights, a real
byte-level BPE tokenizer with a ChatML template) that the loader reads exactly
like a real Ouro-1.4B directory. Everything is made locally and is
byte-for-byte reproducible from ``(seed, overrides, shards)``.

:func:`default_checkpoint` is the bundled demo model (trained, not random) every
command uses when no model is given; :func:`random_checkpoint_config` gives the real 1.4B / 2.6B
shapes for benchmarks that build random-weight models in memory.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import Tensor

from loopline.models.ouro import OuroConfig, OuroForCausalLM, RMSNorm

#: The served model name of the default model (``loopline serve`` without ``--model``).
DEFAULT_CHECKPOINT_NAME = "loopline-demo-ouro"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in Ouro
TOKENIZER_VOCAB_SIZE = 500

# ChatML, as Ouro's template: one block per message, then the assistant prefix.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Written for loopline; the tokenizer is trained on it, so keep it stable
# (changing it changes every test checkpoint's tokenizer).
_CORPUS = """\
The river town woke slowly. Fishermen pulled their boats onto the gravel, and the
baker opened her shutters before the sun had cleared the hills. Children ran along
the harbour wall, counting gulls: one, two, three, twelve, forty-seven.

A looped language model reads the same layers again and again. Each pass refines
the hidden state of every token, and a small gate decides when the answer is good
enough to stop. Easy tokens leave after one or two loops; hard tokens keep thinking.

"Where are you going?" asked the old man at the gate. "To the market," said the
girl, "to sell apples and buy bread." He smiled and told her the road was long,
but the weather was kind, and the price of apples was higher than last year.

In the library there were maps of distant islands, letters from sailors, and a
notebook full of numbers: 3.14159, 2.71828, 1.41421, 1024, 65536 and 49152.
The librarian wrote every new title in a ledger, with the date and the shelf.

Question: What is the capital of France? Answer: Paris is the capital of France.
Question: How many days are in a week? Answer: There are seven days in a week.
Question: What do plants need to grow? Answer: Plants need light, water and air.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

The system is simple: a scheduler chooses the work, a runner executes it, and the
results flow back in order. When a request finishes, its memory is returned to the
pool, and the next request in the queue takes its place without waiting.
"""

_TINY_DEFAULTS: dict = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    total_ut_steps=4,
    early_exit_threshold=1.0,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_ids=(0,),
    pad_token_id=None,
    torch_dtype="float32",
    initializer_range=0.02,
)

# config.json keys that OuroConfig does not model; overrides may set them so
# tests can write configs the loader has to accept or reject.
_HF_ONLY_DEFAULTS: dict = dict(
    hidden_act="silu",
    tie_word_embeddings=False,
    use_sliding_window=False,
    sliding_window=None,
    rope_scaling=None,
    attention_dropout=0.0,
    use_cache=True,
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tiny_config(**overrides) -> OuroConfig:
    """The default tiny :class:`OuroConfig` with ``overrides`` (OuroConfig field names,
    or ``eos_token_id`` as an int or list)."""
    config, _ = _split_overrides(overrides)
    return config


def _split_overrides(overrides: dict) -> tuple[OuroConfig, dict]:
    fields = dict(_TINY_DEFAULTS)
    hf_only = dict(_HF_ONLY_DEFAULTS)
    names = {f.name for f in dataclasses.fields(OuroConfig)} - {"extra"}
    for key, value in overrides.items():
        if key == "eos_token_id":
            fields["eos_token_ids"] = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        elif key in names:
            fields[key] = tuple(value) if key == "eos_token_ids" else value
        elif key in hf_only:
            hf_only[key] = value
        else:
            allowed = sorted(names | set(hf_only) | {"eos_token_id"})
            raise TypeError(f"make_tiny_checkpoint: unknown config override {key!r}; allowed: {', '.join(allowed)}")
    if fields["torch_dtype"] not in _DTYPES:
        raise ValueError(f"torch_dtype={fields['torch_dtype']!r}; allowed: {', '.join(_DTYPES)}")
    if fields["vocab_size"] < TOKENIZER_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={fields['vocab_size']} is smaller than the tiny tokenizer's {TOKENIZER_VOCAB_SIZE} entries"
        )
    if fields["num_attention_heads"] % fields["num_key_value_heads"] != 0:
        raise ValueError(
            f"num_attention_heads={fields['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads={fields['num_key_value_heads']}"
        )
    return OuroConfig(**fields), hf_only


# --- weights ------------------------------------------------------------------------


def random_state_dict(config: OuroConfig, seed: int = 0, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Seeded random weights for ``config`` under the Hugging Face names, in model order.

    Linear and embedding weights ~ N(0, initializer_range); RMSNorm weights
    ~ 1 + N(0, 0.1), so a test that drops or misplaces a norm sees a difference.

    NOTE: the exit gate is deliberately *not* at initializer scale. Its input
    h_r is the output of the final RMSNorm, so its entries are ~unit size and
    the gate logit w.h has std ~ std(w) * sqrt(hidden). With std(w) = 0.02 that
    logit would be ~0 for every token (lambda ~ 0.5 everywhere) and every token
    would cross an adaptive threshold at the same loop. With std(w) =
    2/sqrt(hidden) the logit has std ~2, and the N(0, 0.5) bias shifts it per
    seed, so lambdas spread over roughly (0.1, 0.9) and vary by token and loop:
    tiny models exit at *varied* depths, which is what the CDB tests need.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = OuroForCausalLM(config)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    norms = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, RMSNorm)}
    out_dtype = dtype if dtype is not None else _DTYPES[config.torch_dtype]
    gate_std = 2.0 / config.hidden_size**0.5
    weights: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name in norms:
            value = 1.0 + 0.1 * noise
        elif name == "model.early_exit_gate.weight":
            value = gate_std * noise
        elif name == "model.early_exit_gate.bias":
            value = 0.5 * noise
        else:
            value = config.initializer_range * noise
        weights[name] = value.to(out_dtype).contiguous()
    return weights


# --- tokenizer ----------------------------------------------------------------------


def _train_tokenizer():
    """Byte-level BPE (GPT-2 / SmolLM2 style) trained on the built-in corpus.

    Training is deterministic: counts are exact and ties between equally
    frequent pairs are broken by the pair itself, not by thread timing.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, (token, tokenizer.token_to_id(token))
    return tokenizer


THINK_TOKENS = ("<think>", "</think>")  # added by make_tiny_checkpoint(thinking=True), as -Thinking tokenizers may have


def _write_tokenizer(path: Path, config: OuroConfig, thinking: bool = False) -> None:
    tokenizer = _train_tokenizer()
    if thinking:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    assert tokenizer.get_vocab_size() <= config.vocab_size, (tokenizer.get_vocab_size(), config.vocab_size)
    (path / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    # Upstream Ouro sets bos = eos = pad = <|endoftext|>; chat ends at <|im_end|>.
    eot = SPECIAL_TOKENS[0]
    specials = {
        "bos_token": eot,
        "eos_token": eot,
        "pad_token": eot,
        "unk_token": eot,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "model_max_length": config.max_position_embeddings,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(path / "tokenizer_config.json", tokenizer_config)
    _write_json(path / "special_tokens_map.json", specials)


# --- checkpoint directory -----------------------------------------------------------


def _config_json(config: OuroConfig, hf_only: dict) -> dict:
    eos = list(config.eos_token_ids)
    return {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "total_ut_steps": config.total_ut_steps,
        "early_exit_threshold": config.early_exit_threshold,
        "max_position_embeddings": config.max_position_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": config.torch_dtype,
        "initializer_range": config.initializer_range,
        **hf_only,
    }


def make_tiny_checkpoint(path: str | os.PathLike, seed: int = 0, *, shards: int = 1, thinking: bool = False,
                         **config_overrides) -> Path:
    """Write a complete, deterministic tiny Ouro checkpoint directory at ``path``.

    ``config_overrides`` replace the tiny defaults (OuroConfig field names, or
    the config.json names ``eos_token_id``, ``hidden_act``,
    ``tie_word_embeddings``, ``use_sliding_window``, ``sliding_window``,
    ``rope_scaling``, ``attention_dropout``, ``use_cache``). ``shards > 1``
    writes ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` instead of ``model.safetensors``. The
    same ``(seed, shards, overrides)`` always give the same bytes. ``thinking=True``
    adds ``<think>`` and ``</think>`` to the tokenizer as (non-special) added
    tokens and names the checkpoint ``tiny-ouro-thinking`` (``_name_or_path``),
    which makes the chat path treat it as a -Thinking checkpoint.
    """
    from safetensors.torch import save_file

    config, hf_only = _split_overrides(config_overrides)
    weights = random_state_dict(config, seed)
    if not 1 <= shards <= len(weights):
        raise ValueError(f"shards={shards}; allowed: 1..{len(weights)} (one tensor per shard at most)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # A previous call with another shard count must not leave weights behind.
    for stale in [*path.glob("model-*-of-*.safetensors"), path / "model.safetensors", path / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)

    _write_json(path / "config.json", {**_config_json(config, hf_only),
                                       **({"_name_or_path": "tiny-ouro-thinking"} if thinking else {})})
    eos_ids = list(dict.fromkeys([*config.eos_token_ids, 2]))  # also stop at <|im_end|>
    _write_json(path / "generation_config.json", {"bos_token_id": config.bos_token_id, "eos_token_id": eos_ids})
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(weights, str(path / "model.safetensors"), metadata=metadata)
    else:
        names = list(weights)
        weight_map: dict[str, str] = {}
        for i in range(shards):
            # Contiguous, near-equal runs of tensors in model order.
            part = names[i * len(names) // shards : (i + 1) * len(names) // shards]
            filename = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: weights[n] for n in part}, str(path / filename), metadata=metadata)
            weight_map.update(dict.fromkeys(part, filename))
        total = sum(t.numel() * t.element_size() for t in weights.values())
        _write_json(path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_tokenizer(path, config, thinking)
    return path


#: The bundled default model: trained in-tree (docs/training.md), weights and card beside this file.
DEMO_CHECKPOINT = Path(__file__).resolve().parent / "demo_ouro"


def default_checkpoint() -> Path:
    """The bundled demo model every command uses when no model is given (``loopline/models/demo_ouro``).

    A 5.5M-parameter Ouro-architecture model trained on the Python source of the standard library and twelve
    packages by ``loopline train pretrain`` (preset ``demo-large``; its ``MODEL_CARD.md`` says how and how well).
    """
    if not (DEMO_CHECKPOINT / "model.safetensors").is_file():
        raise FileNotFoundError(f"the bundled demo model is missing from {DEMO_CHECKPOINT} (an incomplete install?); "
                                "give a checkpoint directory with --model / LLM(model=...)")
    return DEMO_CHECKPOINT


def random_checkpoint_config(name: str) -> OuroConfig:
    """OuroConfig with the real shapes of ``"ouro-1.4b"`` or ``"ouro-2.6b"``
    (``-thinking`` variants share them), for random-weight benchmarks."""
    key = name.lower().removeprefix("bytedance/").removesuffix("-thinking")
    layers = {"ouro-1.4b": 24, "ouro-2.6b": 48}
    if key not in layers:
        raise ValueError(f"unknown checkpoint name {name!r}; allowed: ouro-1.4b, ouro-2.6b")
    # NOTE: OuroConfig's defaults are the Ouro-1.4B config; the 2.6B only doubles the layers.
    return OuroConfig(num_hidden_layers=layers[key])


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
