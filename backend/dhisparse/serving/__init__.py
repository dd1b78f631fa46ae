"""Serving: ``dhisparse-serve`` (the real Triton server over the model repository), the Python backend's engine
service, metrics, the model repositories (co-located and disaggregated)."""
