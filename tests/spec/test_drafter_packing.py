"""``dhisparse-build --drafter DIR``: each format is recognised from its ``config.json``, checked against the target
(tensor shapes, hidden size, vocabulary, target layers) with errors naming the tensor or field, and packed under
``drafters/<family>``; an unknown format is refused with the supported ones. Driven through the CLI's ``main``,
as a user runs it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from published_drafters import add_v4_dspark, qwen_drafter_config, write_qwen_drafter
from safetensors.torch import load_file, save_file
from tiny_v4 import make_v4_checkpoint

from dhisparse.errors import ConfigError
from dhisparse.spec.published import detect_format, drafter_footprint
from dhisparse_builder.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "drafters"


def _drafter(root: Path, fmt: str, **extra) -> Path:
    cfg = qwen_drafter_config(fmt, hidden=64, vocab=96, target_layers=4, layer_ids=[0, 2], **extra)
    return write_qwen_drafter(root / f"{fmt}-src", cfg, 64)


def _build(checkpoint: Path, out: Path, *drafters: Path, extra: tuple[str, ...] = ()) -> int:
    args = ["--checkpoint", str(checkpoint), "--output", str(out), "--force", *extra]
    for d in drafters:
        args += ["--drafter", str(d)]
    return main(args)


def test_every_format_is_recognised_and_packed_by_family(tiny_checkpoint, tmp_path, capsys):
    drafters = [_drafter(tmp_path, fmt) for fmt in ("dflash", "dflash2", "dspark")]
    assert _build(tiny_checkpoint("glm_fsfs_sparse"), tmp_path / "engine", *drafters,
                  extra=("--speculative", "dflash")) == 0
    for fmt in ("dflash", "dflash2", "dspark"):
        packed = tmp_path / "engine" / "drafters" / fmt
        assert detect_format(json.loads((packed / "config.json").read_text()), fmt) == fmt
    runtime = json.loads((tmp_path / "engine" / "runtime.json").read_text())
    assert runtime["speculative"] == "dflash"


def test_reference_fixture_checkpoints_are_recognised():
    for case in ("dflash", "dflash2", "dflash2_swa", "dspark_vanilla", "dspark_gated", "dspark_rnn"):
        want = case.split("_")[0]
        assert detect_format(json.loads((FIXTURES / case / "checkpoint" / "config.json").read_text()), case) == want


def test_deepseek_v4_checkpoint_packs_only_its_dspark_stages(tiny_root, tmp_path):
    checkpoint = add_v4_dspark(make_v4_checkpoint(tiny_root, "v4_small_topk"), tmp_path / "v4")
    assert _build(checkpoint, tmp_path / "engine", checkpoint) == 0
    packed = tmp_path / "engine" / "drafters" / "dspark"
    names = set(load_file(str(packed / "model.safetensors")))
    assert names and all(n.startswith("mtp.") for n in names)
    assert {n.split(".")[1] for n in names} == {"0", "1", "2"}


@pytest.mark.parametrize("mutate, message", [
    ("fc", "fc.weight: shape [64, 96], the config implies [64, 128]"),
    ("missing", "layers.1.mlp.down_proj.weight: missing"),
    ("unexpected", "lm_head.weight: unexpected tensor"),
    ("vocab", "vocab_size is 100, the target's is 96"),
    ("hidden", "hidden_size is 32, the target's is 64"),
    ("layers", "dflash_config.target_layer_ids [0, 3] names layers [3]"),
    ("num_target_layers", "num_target_layers is 6, the target has 4 layers"),
    ("mask", "dflash_config.mask_token_id 96 is outside the vocabulary"),
    ("selector", "required field dflash_config.selector_top_k is missing"),
])
def test_bad_drafters_are_refused_naming_the_tensor_or_field(tiny_checkpoint, tmp_path, capsys, mutate, message):
    fmt = "dflash2" if mutate == "selector" else "dflash"
    src = _drafter(tmp_path, fmt)  # a valid drafter, then one thing wrong
    changes = {"vocab": {"vocab_size": 100}, "hidden": {"hidden_size": 32},
               "layers": {"dflash_config": {"target_layer_ids": [0, 3]}}, "num_target_layers": {"num_target_layers": 6},
               "mask": {"dflash_config": {"mask_token_id": 96}}}.get(mutate, {})
    cfg = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    (src / "config.json").write_text(json.dumps(cfg))
    if mutate in ("fc", "missing", "unexpected"):
        tensors = load_file(str(src / "model.safetensors"))
        if mutate == "fc":
            tensors["fc.weight"] = torch.zeros(64, 96)
        elif mutate == "missing":
            del tensors["layers.1.mlp.down_proj.weight"]
        else:
            tensors["lm_head.weight"] = torch.zeros(96, 64)
        save_file(tensors, str(src / "model.safetensors"))
    if mutate == "selector":
        del cfg["dflash_config"]["selector_top_k"]
        (src / "config.json").write_text(json.dumps(cfg))
    assert _build(tiny_checkpoint("glm_fsfs_sparse"), tmp_path / "engine", src) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "engine").exists()  # nothing half-written


def test_unknown_format_is_refused_with_the_supported_ones(tiny_checkpoint, tmp_path, capsys):
    src = _drafter(tmp_path, "dflash")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["Eagle3DraftModel"]
    (src / "config.json").write_text(json.dumps(cfg))
    assert _build(tiny_checkpoint("glm_fsfs_sparse"), tmp_path / "engine", src) == 2
    err = capsys.readouterr().err
    assert "not a drafter format this runtime reads" in err and "DFlashDraftModel" in err
    assert "Qwen3DSparkModel" in err and "DFlash2DraftModel" in err and "deepseek_v4" in err


def test_two_drafters_of_one_family_and_a_missing_family_are_refused(tiny_checkpoint, tmp_path, capsys):
    a = _drafter(tmp_path, "dflash")
    b = tmp_path / "dflash-copy"
    shutil.copytree(a, b)
    assert _build(tiny_checkpoint("glm_fsfs_sparse"), tmp_path / "engine", a, b) == 2
    assert "two drafters of family 'dflash'" in capsys.readouterr().err
    assert _build(tiny_checkpoint("glm_fsfs_sparse"), tmp_path / "engine", a, extra=("--speculative", "dspark")) == 2
    assert "speculative='dspark' needs a drafter of that family" in capsys.readouterr().err


def test_v4_dspark_is_refused_for_a_target_it_does_not_fit(tiny_root, tiny_checkpoint, tmp_path, capsys):
    checkpoint = add_v4_dspark(make_v4_checkpoint(tiny_root, "v4_small_topk"), tmp_path / "v4")
    assert _build(tiny_checkpoint("glm_fsfs_sparse"), tmp_path / "engine", checkpoint) == 2
    assert "needs a deepseek_v4 target" in capsys.readouterr().err


def test_config_errors_name_the_field():
    cfg = qwen_drafter_config("dspark", hidden=64, vocab=96, target_layers=4, layer_ids=[0, 2],
                              markov_head_type="lstm")
    with pytest.raises(ConfigError, match="markov_head_type must be one of"):
        drafter_footprint(cfg, max_context=1024)


def test_footprint_of_a_sliding_window_dflash2_drafter():
    cfg = qwen_drafter_config("dflash2", hidden=64, vocab=96, target_layers=4, layer_ids=[0, 2],
                              layer_types=["sliding_attention"] * 2, sliding_window=2048)
    fp = drafter_footprint(cfg, max_context=1 << 20, bytes_per_value=2)
    assert (fp.window_rows, fp.layers, fp.row_values, fp.max_gamma) == (2047, 2, 2 * 2 * 2 * 16, 4)
    assert fp.ring_bytes == 2047 * 128 * 2
    full = drafter_footprint(qwen_drafter_config("dflash", hidden=64, vocab=96, target_layers=4, layer_ids=[0, 2]),
                             max_context=1000, bytes_per_value=2)
    assert full.window_rows is None and full.ring_bytes == 1000 * 128 * 2
