"""What the OpenAI front end costs: the same greedy request through the ensemble (Triton gRPC stream) and through
`/v1/completions` (SSE), alternating on one server, medians and their ratio.

    python scripts/bench_openai_front.py --engine build/demo-engine [--prompt-tokens 1024] [--max-tokens 32] \
        [--repeats 15] [--pool-bytes 8000000]

Starts `dhisparse-serve --openai-port 0`, warms both paths up, then measures `--repeats` pairs (the order alternates
per pair): time to first text and time to the last, per path. Both paths generate the same tokens from the same
prompt (the script checks the texts are equal), so the difference is the front end: tokenizing, the asynchronous
gRPC client, detokenizing and server-sent events against preprocessing/postprocessing in the ensemble.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import openai

from dhisparse_client import DHiSparseClient, GenerationOptions
from dhisparse_client.prompts import cut_prompts, shakespeare_text
from dhisparse_client.serve_process import ServeProcess


def _ensemble(client: DHiSparseClient, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    start = time.perf_counter()
    first, chunks = None, []
    for chunk in client.stream(prompt, GenerationOptions(max_tokens=max_tokens, temperature=0.0)):
        first = first or time.perf_counter()
        chunks.append(chunk)
    return first - start, time.perf_counter() - start, b"".join(chunks).decode()


def _openai(api: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    start = time.perf_counter()
    first, texts = None, []
    for chunk in api.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        stream=True):
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            texts.append(chunk.choices[0].text)
    return first - start, time.perf_counter() - start, "".join(texts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, required=True)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--pool-bytes", type=int, default=8_000_000)
    args = p.parse_args(argv)
    prompt = cut_prompts(shakespeare_text(), args.engine / "tokenizer.json", 1, args.prompt_tokens)[0]
    serve = ServeProcess(args.engine, {"pool_bytes": args.pool_bytes}, extra_args=["--openai-port", "0"])
    endpoints = serve.start()
    try:
        client = DHiSparseClient(endpoints.grpc_url, endpoints.http_url, endpoints.metrics_url)
        api = openai.OpenAI(base_url=endpoints.openai_url, api_key="unused", max_retries=0, timeout=300)
        paths = {"ensemble": lambda: _ensemble(client, prompt, args.max_tokens),
                 "openai": lambda: _openai(api, endpoints.openai_model, prompt, args.max_tokens)}
        texts = {name: run()[2] for name, run in paths.items()}  # warm-up
        if texts["ensemble"] != texts["openai"]:
            print("the two paths generated different text", file=sys.stderr)
            return 1
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
        for i in range(args.repeats):
            for name in (("ensemble", "openai") if i % 2 == 0 else ("openai", "ensemble")):
                times[name].append(paths[name]()[:2])
    finally:
        serve.stop()
    medians = {name: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v))
               for name, v in times.items()}
    for name, (ttft, total) in medians.items():
        print(f"{name:8s}  first text {1000 * ttft:8.1f} ms   last {1000 * total:8.1f} ms")
    print(f"openai / ensemble: first text {medians['openai'][0] / medians['ensemble'][0]:.3f}x, "
          f"last {medians['openai'][1] / medians['ensemble'][1]:.3f}x  ({args.repeats} pairs, medians, "
          f"{args.prompt_tokens}-token prompt, {args.max_tokens} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
