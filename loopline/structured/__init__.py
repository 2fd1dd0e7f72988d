"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar."""
from loopline.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
