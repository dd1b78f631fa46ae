"""DeepSeek-V4 runtime: config, checkpoint names, compressors (CSA/HCA), lightning indexer over compressed
entries, sliding-window attention with sinks, mHC residual streams, sqrtsoftplus and hash-routed MoE."""
