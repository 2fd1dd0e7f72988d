"""Loop-aware self-speculative decoding (issue #41): the first loops of a looped model draft, the deeper
loops verify. Here: the config (:mod:`.config`), the cost model of both schemes (:mod:`.cost`) and a
plain-PyTorch reference of both, draft-then-verify and the depth pipeline (:mod:`.reference`). The engine
runs draft-then-verify rounds with ``speculative_config`` (it refuses the pipeline: not built there yet):
the scheduler's side in ``loopline.core.speculation``, the device's in ``loopline.worker.spec_rows``
(docs/speculation.md)."""
from loopline.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
