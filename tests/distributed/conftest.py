"""The entrypoint tests' fixtures, shared: engine arguments over the tiny GQA checkpoint and real
uvicorn servers (tests/entrypoints/conftest.py)."""
from entrypoints.conftest import make_engine_args, serve_app  # noqa: F401  (pytest finds fixtures by name)
