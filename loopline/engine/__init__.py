"""The engine (``LLMEngine``) and its processors: input validation, output processing, RL control."""
from loopline.engine.input_processor import PromptType
from loopline.engine.llm_engine import EngineStats, LLMEngine

__all__ = ["LLMEngine", "EngineStats", "PromptType"]
