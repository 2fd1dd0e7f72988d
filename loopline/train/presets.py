"""Named training configurations (``loopline train pretrain --preset``) and how flags build a config.

Standard library only at import (``loopline --help`` lists the presets without torch); the trainer's
:class:`TrainConfig` is imported when a config is built.
"""
from __future__ import annotations

import json
from typing import Any

from loopline.errors import InvalidRequestError

#: Installed distributions of ``demo-large``'s corpus: torch and transformers, the packages they pull in on the
#: H200 machine (sympy, mpmath, networkx, jinja2 and setuptools through torch; numpy, huggingface-hub and, through
#: typer, rich and pygments through transformers) and triton. Every one is on the license allow-list
#: (loopline/train/licenses.py) in the versions there and in the dev environment; about 140 MB of .py text.
DEMO_LARGE_PACKAGES = ("torch", "transformers", "triton", "numpy", "sympy", "mpmath", "networkx", "jinja2",
                       "setuptools", "huggingface-hub", "rich", "pygments")

#: Named configurations. ``demo-large`` (the default): the bundled model's run, the standard library plus
#: DEMO_LARGE_PACKAGES (~40M tokens, each seen four times in stage 1), 10,000 + 800 compiled steps (~9 minutes on
#: an H200);
#: ``demo``: the same model on the standard library alone (2.3M tokens), 1,200 + 200 steps, the first bundled
#: model's run (~2 minutes); ``smoke``: a few KB of corpus and a 64-wide model, seconds on a CPU.
#: The preset of the bundled model's run (``tests/models/test_demo_model.py`` checks its training_info against it).
SHIPPED_PRESET = "demo-large"
PRESETS: dict[str, dict[str, Any]] = {
    "demo": {},  # the TrainConfig defaults are the demo run (the first bundled model)
    "demo-large": {
        # a budget above the whole selection (~150 MB there): every accepted file is in, none is cut
        "corpus": {"packages": list(DEMO_LARGE_PACKAGES), "max_bytes": 200_000_000},
        # compiled (~40 ms a step on an H200), 10,000 + 800 steps fit one 10-minute device call with the data,
        # the compile and the export
        "compile": "inductor",
        "stage1_steps": 10000, "warmup_steps": 838,
        "stage2_steps": 800, "stage2_warmup_steps": 80,
        # the gate holds its initial exit distribution through stage 1, p = (0.15, 0.13, 0.11, 0.61): a gate that
        # learns moves mass to the early loops, which then train on the easy tokens the last loop never sees,
        # and the fourth loop ends behind the third (docs/training.md); stage 2 then trains the gate alone
        "gate_init_exit": 0.15, "gate_freeze_steps": 10000,
        "eval_batches": 16,  # 262k held-out tokens: the split mixes sources, the first 8 batches are few files
    },
    "smoke": {
        "model": {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256},
        "corpus": {"max_bytes": 120_000, "heldout_per_mille": 200},
        "seq_len": 64, "batch_size": 8, "stage1_steps": 30, "stage2_steps": 20, "lr": 1e-2, "warmup_steps": 5,
        "stage2_lr": 3e-2, "stage2_warmup_steps": 2, "eval_batches": 2,
    },
}


def build_config(preset: str, config_file: str | None, sets: list[str]):
    """The :class:`TrainConfig` of a preset, a JSON file over it and ``FIELD=VALUE`` overrides over both."""
    from loopline.train.trainer import TrainConfig

    raw = json.loads(json.dumps(PRESETS[preset]))  # a deep copy
    if config_file:
        try:
            with open(config_file, encoding="utf-8") as fh:
                extra = json.load(fh)
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"--config-file {config_file}: not UTF-8 text (byte {e.start}: {e.reason})",
                                      param="--config-file") from None
        except OSError as e:
            raise InvalidRequestError(f"--config-file {config_file}: {e.strerror or e}", param="--config-file") from None
        except (ValueError, RecursionError) as e:
            raise InvalidRequestError(f"--config-file {config_file}: invalid JSON ({e})", param="--config-file") from None
        if not isinstance(extra, dict):
            raise InvalidRequestError(f"--config-file {config_file}: expected a JSON object of TrainConfig fields, "
                                      f"got {type(extra).__name__}", param="--config-file")
        _merge(raw, extra)
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequestError(f"--set {item!r}; allowed: FIELD=VALUE, e.g. --set stage1_steps=100")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise InvalidRequestError(f"--set {item!r}: {part} is not a group of fields")
        node[leaf] = parsed
    return TrainConfig.from_dict(raw)


def _merge(base: dict, extra: dict) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
