"""Published drafters through `dhisparse-serve`: an engine packing z-lab DFlash, DFlash2 and DeepSpec's Qwen3 DSpark
drafters, served by the real CLI once per drafter family (`--speculative`), and a DeepSeek-V4 engine with its
`mtp.*` DSpark stages give the greedy tokens of their target alone; the server's metrics report the acceptance per
verification step. The four servers start side by side."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from published_drafters import add_v4_dspark, qwen_drafter_config, write_qwen_drafter
from tiny_v4 import make_v4_checkpoint

from dhisparse import LLM, SamplingParams
from dhisparse_client import DHiSparseClient, GenerationOptions

FAMILIES = ("dflash", "dflash2", "dspark")
PROMPTS = [[5, 17, 44, 301, 2], [9, 9, 130, 77, 12, 250, 41, 3, 8], [200, 6]]
MAX_TOKENS = 16


def _metrics_after_the_requests(client: DHiSparseClient, timeout_s: float = 30.0) -> dict[str, float]:
    """The server's engine metrics once its periodic refresh has seen the verification steps."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = client.metrics()
        if metrics.get("verify_steps", 0.0) > 0 or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def test_each_published_format_serves_the_targets_greedy_tokens(tmp_path_factory):
    from tiny_engine import MAX_POSITIONS, build_checkpoint

    from dhisparse_builder.build import BuildOptions, build_engine
    from dhisparse_client.serve_process import ServeProcess

    root = tmp_path_factory.mktemp("published-serve")
    checkpoint = build_checkpoint(root / "checkpoint")
    drafters = tuple(write_qwen_drafter(root / fmt, qwen_drafter_config(fmt, hidden=64, vocab=320, target_layers=2,
                                                                        layer_ids=[0]), 64, seed=i)
                     for i, fmt in enumerate(FAMILIES))
    engine = build_engine(BuildOptions(checkpoint, root / "engine", {"max_model_len": MAX_POSITIONS},
                                       drafters=drafters), progress=lambda d, t: None)
    v4_checkpoint = add_v4_dspark(make_v4_checkpoint(root, "v4_small_topk"), root / "v4_dspark")
    v4_engine = build_engine(BuildOptions(v4_checkpoint, root / "v4_engine", {}, drafters=(v4_checkpoint,)),
                             progress=lambda d, t: None)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    prompts_v4 = [[t % 97 for t in p] for p in PROMPTS]
    want = {f: [o.token_ids for o in LLM(engine, kv_policy="dense").generate(PROMPTS, params)] for f in FAMILIES}
    want["v4"] = [o.token_ids for o in LLM(v4_engine).generate(prompts_v4, params)]
    servers = {}
    try:
        for family in FAMILIES:  # one server per family
            # A full-attention drafter's ring holds the whole history (513 rows here): it is required memory.
            options = {"kv_policy": "adaptive", "pool_bytes": 1 << 21, "page_rows": 16, "speculative": family,
                       "num_draft_tokens": 3}
            servers[family] = ServeProcess(engine, options, log_path=root / f"{family}.log")
        servers["v4"] = ServeProcess(v4_engine, {"kv_policy": "hisparse", "pool_bytes": 1 << 22, "page_rows": 4,
                                                 "speculative": "dspark", "num_draft_tokens": 5},
                                     log_path=root / "v4.log")
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            endpoints = dict(zip(servers, pool.map(lambda s: s.start(), servers.values()), strict=True))
        for family, where in endpoints.items():
            client = DHiSparseClient(where.grpc_url, where.http_url, where.metrics_url, model="dhisparse",
                                     timeout_s=120.0)

            def run(ids: list[int], client: DHiSparseClient = client) -> list[int]:
                return [t for chunk in client.stream_token_ids(ids, GenerationOptions(max_tokens=MAX_TOKENS))
                        for t in chunk]

            with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
                got = list(pool.map(run, prompts_v4 if family == "v4" else PROMPTS))
            assert got == want[family], family
            metrics = _metrics_after_the_requests(client)
            assert metrics["verify_steps"] > 0 and metrics["draft_tokens_proposed"] > 0, family
            assert metrics["tokens_per_verify_step"] >= 1.0, family
    finally:
        for serve in servers.values():
            serve.stop()
