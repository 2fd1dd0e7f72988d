"""loopline: an inference and serving engine for looped language models (Ouro)."""
from loopline.config import EngineArgs
from loopline.entrypoints.async_llm import AsyncLLM
from loopline.entrypoints.llm import LLM
from loopline.outputs import CompletionOutput, Logprob, RequestOutput
from loopline.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
