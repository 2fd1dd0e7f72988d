"""Loop-aware self-speculative decoding (issue #41): the first loops of a looped model draft, the deeper
loops verify. Here: the config (:mod:`.config`), the cost model of both schemes (:mod:`.cost`) and a
plain-PyTorch reference of both, draft-then-verify and the depth pipeline (:mod:`.reference`). The engine
runs both with ``speculative_config``: the scheduler's side in ``loopline.core.speculation``, the device's
in ``loopline.worker.spec_rows`` (draft then verify) and ``loopline.worker.pipe_rows`` (the pipeline)
(docs/speculation.md)."""
from loopline.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
