"""Speculative decoding over the KV hierarchy: drafters, the draft ring buffer, exact acceptance."""
