"""Serving: the OpenAI-compatible server with continuous batching."""
