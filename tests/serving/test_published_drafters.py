"""Published drafters through `dhisparse-serve`: an engine packing z-lab DFlash, DFlash2 and DeepSpec's Qwen3 DSpark
drafters, served by the real CLI once per drafter family (`--speculative`), and a DeepSeek-V4 engine with its
`mtp.*` DSpark stages give the greedy tokens of their target alone under every KV policy; the server's metrics report
the acceptance per verification step.

A server runs one engine configuration (the KV policy and the drafter family are engine options, not per-request
ones), and a start costs ~8 s of CPU here, so each format gets one server, the four servers cover the four policies
between them (`SERVED_POLICY`), and the format's other three policies run through `LLM` on the same engine, the path
the server's model runs, while the servers start. The servers start and stop side by side."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from published_drafters import add_v4_dspark, qwen_drafter_config, write_qwen_drafter
from tiny_v4 import make_v4_checkpoint

from dhisparse import LLM, SamplingParams
from dhisparse_client import DHiSparseClient, GenerationOptions

FAMILIES = ("dflash", "dflash2", "dspark")
POLICIES = ("dense", "resident", "hisparse", "adaptive")
SERVED_POLICY = {"dflash": "dense", "dflash2": "resident", "dspark": "adaptive", "v4": "hisparse"}
PROMPTS = [[5, 17, 44, 301, 2], [9, 9, 130, 77, 12, 250, 41, 3, 8], [200, 6]]
MAX_TOKENS = 16


def _options(case: str, policy: str) -> dict[str, object]:
    """Engine options of `case` (a drafter family of the GLM-style engine, or `v4`) under `policy`."""
    family, gamma = ("dspark", 5) if case == "v4" else (case, 3)
    options: dict[str, object] = {"kv_policy": policy, "speculative": family, "num_draft_tokens": gamma}
    if policy != "dense":
        # A full-attention drafter's ring holds the whole history (513 rows here): it is required memory.
        options.update({"pool_bytes": 1 << 22, "page_rows": 4} if case == "v4" else
                       {"pool_bytes": 1 << 21, "page_rows": 16})
    return options


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
    engines = {**dict.fromkeys(FAMILIES, engine), "v4": v4_engine}
    prompts = {**dict.fromkeys(FAMILIES, PROMPTS), "v4": prompts_v4}
    want = {f: [o.token_ids for o in LLM(engine, kv_policy="dense").generate(PROMPTS, params)] for f in FAMILIES}
    want["v4"] = [o.token_ids for o in LLM(v4_engine).generate(prompts_v4, params)]
    assert sorted(SERVED_POLICY.values()) == sorted(POLICIES)  # every policy goes through a server
    servers = {case: ServeProcess(engines[case], _options(case, policy), log_path=root / f"{case}.log")
               for case, policy in SERVED_POLICY.items()}
    pool = ThreadPoolExecutor(max_workers=len(servers))
    try:
        starting = {case: pool.submit(serve.start) for case, serve in servers.items()}
        for case in servers:  # the other policies through LLM, while the servers start
            for policy in POLICIES:
                if policy == SERVED_POLICY[case]:
                    continue
                llm = LLM(engines[case], **_options(case, policy))
                assert [o.token_ids for o in llm.generate(prompts[case], params)] == want[case], (case, policy)
                assert llm.stats()["verify_steps"] > 0, (case, policy)
        endpoints = {case: future.result() for case, future in starting.items()}
        for case, where in endpoints.items():
            client = DHiSparseClient(where.grpc_url, where.http_url, where.metrics_url, model="dhisparse",
                                     timeout_s=120.0)

            def run(ids: list[int], client: DHiSparseClient = client) -> list[int]:
                return [t for chunk in client.stream_token_ids(ids, GenerationOptions(max_tokens=MAX_TOKENS))
                        for t in chunk]

            with ThreadPoolExecutor(max_workers=len(PROMPTS)) as requests:
                got = list(requests.map(run, prompts[case]))
            assert got == want[case], (case, SERVED_POLICY[case])
            metrics = _metrics_after_the_requests(client)
            assert metrics["verify_steps"] > 0 and metrics["draft_tokens_proposed"] > 0, case
            assert metrics["tokens_per_verify_step"] >= 1.0, case
    finally:
        list(pool.map(lambda serve: serve.stop(), servers.values()))  # side by side: a stop takes seconds
        pool.shutdown()
