"""Benchmark of the KV policies (issue 3) on CPU with a tiny random-init GLM-style DSA model.

Three measurements, every policy side by side in one run under the same pool budget, medians of repeats:

1. ``concurrency``: offered concurrency C (all requests arrive at once) from 1 to 32, prompts long enough that
   ``resident`` is capped by the budget: output tokens/s, mean TTFT, mean TPOT per policy and the ratios
   adaptive/hisparse and adaptive/resident.
2. ``load_step``: low load → high load → drain; per engine step the host-fetched share of selected rows and
   the optional pages resident, for adaptive and hisparse (CSV + PNG).
3. ``resolver``: rows resolved per second by ``dhisparse.kv.resolve`` at batch 1, 8, 32 with index_topk 2048.

Usage: ``PYTHONPATH=backend:engine_builder:client python scripts/bench_kv.py --out out/bench_kv [--quick]``.
Absolute numbers on shared CPUs are noisy; read the ratios (see ../shared/ENVIRONMENT.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

POLICIES = ("resident", "hisparse", "adaptive")
TOPK = 32


def make_engine(root: Path) -> Path:
    """A tiny GLM-style model (FSFS index sharing), saved by transformers and built by dhisparse-build."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from dhisparse_builder import BuildOptions, build_engine

    engine = root / "engine"
    if (engine / "runtime.json").exists():
        return engine
    cfg = GlmMoeDsaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, index_head_dim=16, index_n_heads=16, first_k_dense_replace=1,
        max_position_embeddings=4096, n_group=1, topk_group=1, initializer_range=0.1, bos_token_id=None,
        eos_token_id=None, index_topk=TOPK, index_topk_pattern="FSFS",
    )
    torch.manual_seed(0)
    GlmMoeDsaForCausalLM(cfg).save_pretrained(root / "checkpoint")
    build_engine(BuildOptions(root / "checkpoint", engine, {"dtype": "float32"}), progress=lambda d, t: None)
    return engine


def prompts_of(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (length,), generator=g).tolist() for _ in range(n)]


def kv_options(policy: str, pool_bytes: int, page_rows: int) -> dict:
    return dict(kv_policy=policy, pool_bytes=pool_bytes, page_rows=page_rows, hot_rows=2 * TOPK,
                refill_pages_per_step=16, max_batch_size=64, prefill_chunk_tokens=1024,
                max_prefill_tokens_per_step=8192)


def host_share(stats: dict[str, float]) -> float:
    total = stats["kv_rows_direct"] + stats["kv_rows_hot"] + stats["kv_rows_host"]
    return stats["kv_rows_host"] / total if total else 0.0


# ------------------------------------------------------------------------------------------ concurrency
def run_concurrency(engine: Path, out: Path, levels: list[int], repeats: int, prompt_len: int,
                    new_tokens: int, page_rows: int, resident_fit: int) -> list[dict]:
    from dhisparse import LLM, SamplingParams

    probe = LLM(engine, **kv_options("resident", 1 << 30, page_rows))
    pool_bytes = resident_fit * probe.engine.kv.required_bytes(prompt_len, new_tokens)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    llms = {p: LLM(engine, **kv_options(p, pool_bytes, page_rows)) for p in POLICIES}
    llms["resident"].generate(prompts_of(2, prompt_len, 99), params)  # warm-up
    rows = []
    for c in levels:
        samples: dict[str, list[tuple[float, float, float, float]]] = {p: [] for p in POLICIES}
        for rep in range(repeats):
            prompts = prompts_of(c, prompt_len, seed=1000 * c + rep)
            reference = None
            for policy in POLICIES:  # interleaved, so noise hits every policy alike
                llm = llms[policy]
                before = dict(llm.stats())
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - start
                tokens = [o.token_ids for o in outs]
                if reference is None:
                    reference = tokens
                elif tokens != reference:
                    raise RuntimeError(f"{policy} produced other tokens than resident at C={c}")
                after = llm.stats()
                delta = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("kv_rows")}
                samples[policy].append((
                    sum(len(t) for t in tokens) / wall,
                    statistics.mean(o.stats["ttft_s"] for o in outs),
                    statistics.mean(o.stats["tpot_s"] for o in outs),
                    host_share(delta),
                ))
        row: dict = {"concurrency": c, "pool_bytes": pool_bytes}
        for policy in POLICIES:
            tps, ttft, tpot, share = (statistics.median(v) for v in zip(*samples[policy], strict=True))
            row.update({f"{policy}_tokens_per_s": tps, f"{policy}_mean_ttft_s": ttft,
                        f"{policy}_mean_tpot_s": tpot, f"{policy}_host_share": share})
        row["adaptive_over_hisparse"] = row["adaptive_tokens_per_s"] / row["hisparse_tokens_per_s"]
        row["adaptive_over_resident"] = row["adaptive_tokens_per_s"] / row["resident_tokens_per_s"]
        rows.append(row)
        print(f"C={c:3d}  " + "  ".join(f"{p} {row[f'{p}_tokens_per_s']:7.1f} tok/s" for p in POLICIES)
              + f"  adaptive/hisparse {row['adaptive_over_hisparse']:.2f}"
              + f"  adaptive/resident {row['adaptive_over_resident']:.2f}", flush=True)
    write_csv(out / "concurrency.csv", rows)
    return rows


# ------------------------------------------------------------------------------------------ load step
def run_load_step(engine: Path, out: Path, prompt_len: int, page_rows: int, low: int, high: int,
                  long_tokens: int, short_tokens: int, high_at: int) -> list[dict]:
    from dhisparse import LLM, SamplingParams

    probe = LLM(engine, **kv_options("adaptive", 1 << 30, page_rows))
    kv = probe.engine.kv
    full_optional = kv.layout.num_sources * (prompt_len // page_rows) * kv.pool.page_bytes
    pool_bytes = low * (kv.required_bytes(prompt_len, long_tokens) + full_optional) + kv.pool.page_bytes
    trace = []
    for policy in ("adaptive", "hisparse"):
        engine_obj = LLM(engine, **kv_options(policy, pool_bytes, page_rows)).engine
        for p in prompts_of(low, prompt_len, 5):
            engine_obj.add_request(p, SamplingParams(max_tokens=long_tokens, ignore_eos=True))
        step, prev = 0, engine_obj.stats()
        while engine_obj.has_unfinished():
            if step == high_at:
                for p in prompts_of(high, prompt_len, 6):
                    engine_obj.add_request(p, SamplingParams(max_tokens=short_tokens, ignore_eos=True))
            engine_obj.step()
            now = engine_obj.stats()
            delta = {k: now[k] - prev[k] for k in ("kv_rows_direct", "kv_rows_hot", "kv_rows_host")}
            phase = "low" if step < high_at else ("high" if now["kv_requests_running"] > low else "drain")
            trace.append({"policy": policy, "step": step, "phase": phase,
                          "running": now["kv_requests_running"], "host_share": host_share(delta),
                          "optional_pages_resident": now["kv_optional_pages_resident"],
                          "required_bytes": now["kv_required_bytes"], "optional_bytes": now["kv_optional_bytes"]})
            prev, step = now, step + 1
    write_csv(out / "load_step.csv", trace)
    plot_load_step(trace, out / "load_step.png", pool_bytes)
    return trace


def plot_load_step(trace: list[dict], path: Path, pool_bytes: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    for policy, color in (("adaptive", "tab:blue"), ("hisparse", "tab:orange")):
        rows = [r for r in trace if r["policy"] == policy]
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [100 * r["host_share"] for r in rows], color=color, label=policy)
        axes[1].plot(steps, [r["optional_pages_resident"] for r in rows], color=color, label=policy)
        axes[2].plot(steps, [r["running"] for r in rows], color=color, label=policy)
    axes[0].set_ylabel("host-fetched share of\nselected rows (%)")
    axes[1].set_ylabel("optional pages resident")
    axes[2].set_ylabel("running requests")
    axes[2].set_xlabel(f"engine step (pool {pool_bytes} bytes)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------------ resolver
def run_resolver(out: Path, batches: list[int], topk: int, history: int, hot_rows: int, repeats: int) -> list[dict]:
    from dhisparse.kernels.resolver import resolve

    page_rows = 64
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in batches:
        pages = history // page_rows
        page_table = torch.where(torch.rand(batch, pages, generator=g) < 0.5,
                                 torch.randint(0, 1 << 20, (batch, pages), generator=g), -1)
        hot_pos = torch.stack([torch.randperm(history, generator=g)[:hot_rows] for _ in range(batch)])
        hot_stamp = torch.randint(0, 100, (batch, hot_rows), generator=g)
        hot_loc = torch.arange(batch * hot_rows).view(batch, hot_rows)
        positions = torch.stack([torch.randperm(history, generator=g)[:topk] for _ in range(batch)])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            resolve(positions, page_table, hot_pos, hot_stamp, hot_loc, 1000, page_rows)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        rows.append({"batch": batch, "index_topk": topk, "hot_rows": hot_rows, "history": history,
                     "median_s": median, "rows_per_s": batch * topk / median})
        print(f"resolver batch {batch:3d}: {batch * topk / median / 1e6:.2f} M rows/s", flush=True)
    write_csv(out / "resolver.csv", rows)
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/bench_kv"))
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--only", choices=("concurrency", "load_step", "resolver"), action="append")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(args.only or ("concurrency", "load_step", "resolver"))
    quick = args.quick
    summary: dict = {}
    if "resolver" in only:
        summary["resolver"] = run_resolver(args.out, [1, 8, 32], topk=256 if quick else 2048,
                                           history=4096 if quick else 32768, hot_rows=512 if quick else 4096,
                                           repeats=3 if quick else 7)
    if only & {"concurrency", "load_step"}:
        engine = make_engine(args.out)
        if "concurrency" in only:
            summary["concurrency"] = run_concurrency(
                engine, args.out, [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32], repeats=1 if quick else 3,
                prompt_len=192 if quick else 384, new_tokens=8 if quick else 24, page_rows=16, resident_fit=4)
        if "load_step" in only:
            trace = run_load_step(engine, args.out, prompt_len=192 if quick else 384, page_rows=16, low=2,
                                  high=6 if quick else 10, long_tokens=40 if quick else 160,
                                  short_tokens=8 if quick else 16, high_at=10 if quick else 30)
            summary["load_step"] = {
                f"{p}_{phase}_host_share": statistics.mean(
                    [r["host_share"] for r in trace if r["policy"] == p and r["phase"] == phase] or [0.0])
                for p in ("adaptive", "hisparse") for phase in ("low", "high", "drain")
            }
            print(json.dumps(summary["load_step"], indent=1))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
