"""The OpenAI-compatible HTTP server: `tokenmill serve` (app.py), over an asyncio front of the
engine (async_engine.py); request models (protocol.py), the two generation endpoints (serving.py)
and Prometheus metrics (metrics.py)."""
