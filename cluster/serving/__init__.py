"""Serving on the cache: the transformers engine, the Serve app, OpenAI-compatible HTTP, routing."""
