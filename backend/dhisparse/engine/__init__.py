"""Engine: request lifecycle, continuous batching, sampling, the ``LLM`` API and the serving loop."""
