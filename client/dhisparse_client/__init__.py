"""Client library, `dhisparse-client` and `dhisparse-bench` for a dhisparse Triton server."""

from __future__ import annotations

from dhisparse_client.client import DHiSparseClient, GenerationError, GenerationOptions

__all__ = ["DHiSparseClient", "GenerationError", "GenerationOptions"]
