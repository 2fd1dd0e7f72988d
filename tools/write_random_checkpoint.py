"""Writes a random-weight checkpoint with a real Ouro's shapes to a directory (for serving benchmarks).

    python tools/write_random_checkpoint.py /tmp/ouro-1.4b-random --config ouro-1.4b

The directory is a complete loopline/HF checkpoint (config.json, bf16 safetensors, the tiny tokenizer),
loaded by the same code path as real Ouro weights.
"""
from __future__ import annotations

import argparse
import dataclasses

from loopline.models.tiny import make_tiny_checkpoint, random_checkpoint_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--config", default="ouro-1.4b", help="ouro-1.4b or ouro-2.6b shapes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-hidden-layers", type=int, default=None, help="override the layer count (quick checks)")
    a = ap.parse_args()
    cfg = random_checkpoint_config(a.config)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "extra"}
    if a.num_hidden_layers is not None:
        fields["num_hidden_layers"] = a.num_hidden_layers
    print(make_tiny_checkpoint(a.path, seed=a.seed, **fields))


if __name__ == "__main__":
    main()
