"""Training of looped models on the dense differentiable forward (docs/demo-model.md, docs/training.md).

* :mod:`loopline.train.corpus` -- the offline, PSF-licensed corpus (the interpreter's ``Lib/``) and its held-out split.
* :mod:`loopline.train.tokenizer` -- byte-level BPE with Ouro's special tokens, in the checkpoint's tokenizer files.
* :mod:`loopline.train.objective` -- Ouro's stage-1 (expected loss + entropy) and stage-2 (gate-only) losses.
* :mod:`loopline.train.trainer` -- the seeded trainer: packing, AdamW + cosine, save/resume, export.

Nothing here is imported by inference.
"""
