"""`zoo serve`: the OpenAI-compatible HTTP server (app.py: FastAPI routes; schemas.py: requests
and responses; stream.py: server-sent events; metrics.py: Prometheus), and the
continuous-batching scheduler that runs its requests through the engine (scheduler.py;
seq.py: a request as a sequence)."""
