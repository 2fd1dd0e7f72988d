"""The OpenAI-compatible HTTP server (``loopline serve``): see ``api_server.build_app``."""
