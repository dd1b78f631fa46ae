"""`dhisparse-client`: stream a prompt through the server and print tokens as they arrive (argparse only here)."""

from __future__ import annotations

import argparse
import codecs
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

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
    p.add_argument("--bad-word", action="append", default=[], help="word that may never be generated (repeatable)")
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--min-length", type=int, default=None,
                   help="output length (ending token included) before EOS or a stop word may end it")
    p.add_argument("--embedding-bias", action="append", default=[], metavar="WORD=WEIGHT",
                   help="add WEIGHT to the logits of WORD's tokens (repeatable)")
    p.add_argument("-n", "--num-return-sequences", type=int, default=None, help="independent samples of the prompt")
    p.add_argument("--include-input", action="store_true",
                   help="exclude_input_in_output = false: the text starts with the prompt (without streaming)")
    p.add_argument("--return-log-probs", action="store_true", help="print each sequence's log-probabilities")
    p.add_argument("--return-perf-metrics", action="store_true",
                   help="print each sequence's perf metrics (timings, KV pages, speculation)")
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
    try:
        bias = {word: float(weight) for word, weight in (item.rsplit("=", 1) for item in args.embedding_bias)}
    except ValueError:
        print("dhisparse-client: error: --embedding-bias takes WORD=WEIGHT", file=sys.stderr)
        return 2
    options = GenerationOptions(
        args.max_tokens, args.temperature, args.top_k, args.top_p, args.seed, tuple(args.stop),
        bad_words=tuple(args.bad_word), repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, min_length=args.min_length,
        embedding_bias=bias, num_return_sequences=args.num_return_sequences,
        exclude_input_in_output=False if args.include_input else None, return_log_probs=args.return_log_probs,
        return_perf_metrics=args.return_perf_metrics)
    client = DHiSparseClient(args.url, args.http_url, args.metrics_url, model=args.model)
    if (args.num_return_sequences or 1) > 1 or args.return_log_probs or args.return_perf_metrics:
        try:
            print_sequences(client.stream_options(prompt, options, stream=not args.no_stream))
        except GenerationError as error:
            print(f"\ndhisparse-client: error: {error}", file=sys.stderr)
            return 1
        return 0
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


def print_sequences(responses: Iterator[dict[str, np.ndarray]]) -> None:
    """Collect each sequence's text and extra outputs from `responses`, then print them (text on stdout)."""
    texts: dict[int, bytes] = {}
    extras: dict[int, dict[str, object]] = {}
    for arrays in responses:
        index = int(arrays["sequence_index"].reshape(-1)[0]) if arrays.get("sequence_index") is not None else 0
        texts[index] = texts.get(index, b"") + bytes(arrays["text_output"].reshape(-1)[0])
        seen = extras.setdefault(index, {"output_log_probs": []})
        if arrays.get("output_log_probs") is not None:
            seen["output_log_probs"] += arrays["output_log_probs"].reshape(-1).tolist()
        for name, value in arrays.items():
            if name not in ("text_output", "output_log_probs", "batch_index", "sequence_index") and value is not None:
                seen[name] = value.reshape(-1)[0].item() if value.size == 1 else value.tolist()
    for index in sorted(texts):
        print(f"[sequence {index}] {texts[index].decode('utf-8', 'replace')}")
        for name, value in sorted(extras[index].items()):
            if value != []:
                print(f"  {name} = {value}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
