"""Loop-aware self-speculative decoding (issue #41): the first loops of a looped model draft, the deeper
loops verify. Library objects only for now: the config (:mod:`.config`), the cost model of both schemes
(:mod:`.cost`) and a plain-PyTorch reference of draft-then-verify (:mod:`.reference`); the engine does
not speculate yet (docs/speculation.md says what its integration needs)."""
from loopline.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
