"""`zoo serve`: the OpenAI-compatible HTTP server (app.py: FastAPI routes; schemas.py: requests
and responses; stream.py: server-sent events; metrics.py: Prometheus), and the continuous-batching
scheduler that runs its requests (scheduler.py, seq.py, slots.py: the cache rows it lends)."""
