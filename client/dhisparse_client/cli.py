"""`dhisparse-client`: stream a prompt through the server and print tokens as they arrive (argparse only here)."""

from __future__ import annotations

import argparse
import codecs
import sys
import time
from pathlib import Path

from dhisparse_client.client import DHiSparseClient, GenerationError, GenerationOptions
from dhisparse_client.stats import summarize


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dhisparse-client", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port")
    p.add_argument("--http-url", default="127.0.0.1:8000", help="HTTP host:port (used with --no-stream)")
    p.add_argument("--metrics-url", default=None, help="metrics URL (default: port 8002 on the gRPC host)")
    p.add_argument("--model", default="ensemble", help="ensemble (default) or dhisparse_bls")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--stats-only", action="store_true",
                        help="send nothing: print the server's residency and speculation statistics")
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop word (repeatable)")
    p.add_argument("--no-stream", action="store_true", help="one plain HTTP request instead of gRPC streaming")
    p.add_argument("--stats", action="store_true",
                   help="print the server's residency and speculation statistics afterwards")
    p.add_argument("--all-stats", action="store_true", help="print every dhisparse_* metric afterwards")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stats_only:
        client = DHiSparseClient(args.url, args.http_url, args.metrics_url, model=args.model)
        print(summarize(client.metrics()))
        return 0
    prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    options = GenerationOptions(args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                                tuple(args.stop))
    client = DHiSparseClient(args.url, args.http_url, args.metrics_url, model=args.model)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    start, first, chunks = time.perf_counter(), None, 0
    try:
        if args.no_stream:
            sys.stdout.write(decoder.decode(client.generate(prompt, options), final=True))
            chunks = 1
        else:
            for chunk in client.stream(prompt, options):
                first = first or time.perf_counter()
                chunks += 1
                sys.stdout.write(decoder.decode(chunk))
                sys.stdout.flush()
            sys.stdout.write(decoder.decode(b"", final=True))
    except GenerationError as error:
        print(f"\ndhisparse-client: error: {error}", file=sys.stderr)
        return 1
    total = time.perf_counter() - start
    ttft = f", first chunk after {first - start:.3f} s" if first else ""
    print(f"\n[{chunks} chunk(s) in {total:.3f} s{ttft}]", file=sys.stderr)
    if args.stats or args.all_stats:
        time.sleep(0.6)  # the server refreshes its metrics every 250 ms by default
        metrics = client.metrics()
        if args.all_stats:
            for name, value in sorted(metrics.items()):
                print(f"{name} = {value:g}", file=sys.stderr)
        if args.stats:
            print(summarize(metrics), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
