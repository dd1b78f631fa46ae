"""Runtime defaults shared by the engine (``EngineConfig``), the KV hierarchy (``KVConfig``) and every tool that
models the engine (``dhisparse-plan`` reads them too): one source of truth.

Values:
    KV_POLICY: ``adaptive``.
    PAGE_ROWS: 64 rows per KV page (SGLang's DSA page size, the paper's shared setup).
    HOT_ROWS: 0 = ``index_topk`` of the model: one query's selection, with or without speculation (the rows
        of a verification step that the hot cache cannot take go to verification staging).
    RESERVE_BYTES: 0 (no admission reserve).
    REFILL_PAGES_PER_STEP: 64 optional pages (of any source) refilled from host per step.
    NUM_DRAFT_TOKENS: 4 (``gamma``, verification length ``gamma + 1``).
    MAX_BATCH_SIZE: 32 requests running at once (``EngineConfig.max_batch_size``).
    MAX_PREFILL_TOKENS_PER_STEP: 4096 prompt tokens prefilled per engine step (the first prefill of a step is
        never refused).
    DSPARK_BUSY_BATCH: 8: a batch at least this large counts as busy for DSpark's load-aware shortening.
"""

from __future__ import annotations

KV_POLICY = "adaptive"
PAGE_ROWS = 64
HOT_ROWS = 0
RESERVE_BYTES = 0
REFILL_PAGES_PER_STEP = 64
NUM_DRAFT_TOKENS = 4
MAX_BATCH_SIZE = 32
MAX_PREFILL_TOKENS_PER_STEP = 4096
DSPARK_BUSY_BATCH = 8
