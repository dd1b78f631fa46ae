"""The one table of runtime defaults: what ``EngineConfig`` (and so ``runtime.json``, ``LLM``, ``dhisparse-build`` and
``dhisparse-serve``, whose options default to the engine directory's values), ``KVConfig`` and the planner
(``ServingSpec``, ``dhisparse-plan``) start from, so the planner simulates what the engine runs. A value the planner
models differently (the paper's setup) is a named scenario parameter there, not a second default.
``tests/test_defaults.py`` checks that every config, CLI and ``runtime.json`` agrees with this table.

Sizes are bytes, rows are KV rows (tokens of one source), ``0`` means "derived" where the comment says so.
"""

from __future__ import annotations

DTYPE = "float32"  # weights, compute and KV rows
DEVICE = "auto"  # "auto": the GPU when torch sees one, else the CPU (dhisparse.device.resolve_device)
KV_POLICY = "adaptive"
POOL_BYTES = 256 << 20  # device KV budget; 0 ("auto"): the device's free memory less the workspace bound
HOT_ROWS = 0  # B per request and source; 0: index_topk (one query's selection; verification overflow is staged)
PAGE_ROWS = 64  # rows per KV page (SGLang's DSA page size, the paper's shared setup)
RESERVE_BYTES = 0  # admission reserve kept free
HOST_BYTES = 0  # host store capacity; 0: half of the machine's physical memory
REFILL_PAGES_PER_STEP = 64  # optional pages (of any source) refilled from host per step
MAX_BATCH_SIZE = 32  # requests holding a batch slot at once
MAX_MODEL_LEN = 0  # tokens of one request; 0: the model's max_position_embeddings
MAX_NEW_TOKENS_LIMIT = 0  # largest max_tokens a request may ask; 0: up to max_model_len
PREFILL_CHUNK_TOKENS = 512  # prompt tokens per prefill forward
MAX_PREFILL_TOKENS_PER_STEP = 4096  # prompt tokens admitted per engine step after its first admission
KV_DTYPE = "auto"  # "auto": rows in the model dtype; "fp8": FlashMLA's FP8 rows
INDEX_KEY_DTYPE = "auto"  # "auto": indexer keys in the model dtype; "fp8": e4m3 + a float32 scale per key
STREAM_PREFILL = True  # prompts stream into their host pages chunk by chunk (host-store policies, native rows)
PREFIX_REUSE = True  # a prompt reuses the cached complete pages of earlier requests' sequences (docs/prefix_reuse.md)
SPECULATIVE: str | None = None  # None, "dflash2" or "dspark"
NUM_DRAFT_TOKENS = 4  # gamma: draft tokens per verification (verification length gamma + 1)
DSPARK_BUSY_BATCH = 8  # DSpark: a batch at least this large counts as busy
DSPARK_MIN_CONFIDENCE = 0.0  # DSpark: verify only the draft prefix this likely to be accepted …
DSPARK_BUSY_CONFIDENCE = 0.3  # … or this likely when the batch is busy (load-aware shortening)
FAULT_INJECTION = ""  # drills and tests only: "site@n,…" (engine/faults.py)
KERNELS = "auto"  # auto | cuda | torch
# Several ranks (engine/parallel/, docs/parallel.md): world size = tensor_parallel_size x data_parallel_size.
TENSOR_PARALLEL_SIZE = 1  # ranks splitting attention heads, the indexer and dense layers (latent KV replicated)
DATA_PARALLEL_SIZE = 1  # data-parallel attention ranks, each with its own requests and KV; MLP layers span all ranks
TP_SPLIT_INDEXER = True  # TP: split the indexer's heads (scores all-reduced); False: each rank runs the whole indexer
EXPERT_PARALLEL = False  # MoE experts partitioned across all ranks (data-parallel attention: all-to-all dispatch)
# KV copies and reader epochs complete by the step sequence, never by device event timing (kv/copies.py; always on for
# tensor-parallel ranks, which must take the same KV decisions)
AGREED_COPY_COMPLETION = False
COLLECTIVE_TIMEOUT_S = 60.0  # every torch.distributed collective between ranks fails after this many seconds
