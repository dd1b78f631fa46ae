"""dhisparse-build: conversion, refusal to overwrite, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dhisparse.errors import CheckpointError, ConfigError
from dhisparse_builder.cli import main


def test_build_writes_engine_and_refuses_overwrite(tiny_checkpoint, tmp_path, capsys):
    ckpt = tiny_checkpoint("glm_fsfs_sparse")
    out = tmp_path / "engine"
    assert main(["--checkpoint", str(ckpt), "--output", str(out), "--dtype", "bfloat16",
                 "--kv-policy", "hisparse", "--pool-bytes", "1000000"]) == 0
    assert "converting" in capsys.readouterr().err  # progress is shown
    runtime = json.loads((out / "runtime.json").read_text())
    assert runtime["dtype"] == "bfloat16" and runtime["kv_policy"] == "hisparse" and runtime["pool_bytes"] == 1000000
    weights = load_file(str(out / "model.safetensors"))
    assert weights["model.layers.1.mlp.experts.gate_proj"].shape == (4, 32, 64)  # experts stacked
    assert weights["model.layers.1.mlp.experts.gate_proj"].dtype == torch.bfloat16
    assert weights["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # kept in float32 like transformers
    assert main(["--checkpoint", str(ckpt), "--output", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["--checkpoint", str(ckpt), "--output", str(out), "--force"]) == 0


def _copy(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def _build(src, tmp_path):
    from dhisparse_builder import BuildOptions, build_engine

    return build_engine(BuildOptions(src, tmp_path / "out", {}), progress=lambda d, t: None)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    src = _copy(tiny_checkpoint("glm_fsfs_sparse"), tmp_path)
    w = load_file(str(src / "model.safetensors"))
    del w["model.layers.2.self_attn.indexer.wk.weight"]
    save_file(w, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.self_attn\.indexer\.wk\.weight: missing"):
        _build(src, tmp_path)
    assert not (tmp_path / "out").exists()


def test_misshaped_tensor_is_named(tiny_checkpoint, tmp_path):
    src = _copy(tiny_checkpoint("dsv32_sparse_yarn"), tmp_path)
    w = load_file(str(src / "model.safetensors"))
    w["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    save_file(w, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight: shape \[3, 3\], expected \[128, 32\]"):
        _build(src, tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"indexer_types": ["full", "shared"]}, "indexer_types has 2 entries for 4 layers"),
        ({"indexer_types": ["shared", "full", "full", "full"]}, "first layer must run its own indexer"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type 'longrope' is not supported"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"kv_lora_rank": None}, "lacks the required field 'kv_lora_rank'"),
    ],
)
def test_inconsistent_config_is_refused(tiny_checkpoint, tmp_path, change, message):
    src = _copy(tiny_checkpoint("glm_fsfs_sparse"), tmp_path)
    raw = json.loads((src / "config.json").read_text())
    raw.update(change)
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=message):
        _build(src, tmp_path)


def test_sharded_and_per_expert_checkpoints_load(tiny_checkpoint, tmp_path):
    from dhisparse.model import DSAModel

    src = _copy(tiny_checkpoint("glm_fsfs_sparse"), tmp_path)
    w = load_file(str(src / "model.safetensors"))
    names = sorted(w)
    half = len(names) // 2
    (src / "model.safetensors").unlink()
    save_file({n: w[n] for n in names[:half]}, str(src / "model-00001-of-00002.safetensors"))
    save_file({n: w[n] for n in names[half:]}, str(src / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {n: ("model-00001-of-00002.safetensors" if i < half else
                                "model-00002-of-00002.safetensors") for i, n in enumerate(names)}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    a = DSAModel.from_checkpoint(src, dtype=torch.float64).prefill([1, 2, 3, 4, 5]).logits
    original = DSAModel.from_checkpoint(tiny_checkpoint("glm_fsfs_sparse"), dtype=torch.float64)
    b = original.prefill([1, 2, 3, 4, 5]).logits
    assert torch.equal(a, b)


def test_bad_runtime_option_is_refused_before_conversion(tiny_checkpoint, tmp_path, capsys):
    assert main(["--checkpoint", str(tiny_checkpoint("glm_fsfs_sparse")), "--output", str(tmp_path / "e"),
                 "--page-rows", "0"]) == 2
    assert "page_rows must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("victim", ["file", "empty", "foreign", "engine_plus"])
def test_force_refuses_paths_that_are_not_engine_directories(tiny_checkpoint, tmp_path, capsys, victim):
    """`--force` replaces an engine directory only: a file, an empty or foreign directory, or an engine directory
    holding anything else is refused and left as it was."""
    ckpt = tiny_checkpoint("glm_fsfs_sparse")
    out = tmp_path / "target"
    if victim == "file":
        out.write_text("precious")
    else:
        out.mkdir()
        if victim == "foreign":
            (out / "notes.txt").write_text("precious")
    if victim == "engine_plus":
        shutil.rmtree(out)
        assert main(["--checkpoint", str(ckpt), "--output", str(out)]) == 0
        (out / "notes.txt").write_text("precious")
    before = sorted(p.name for p in out.iterdir()) if out.is_dir() else out.read_text()
    capsys.readouterr()
    assert main(["--checkpoint", str(ckpt), "--output", str(out), "--force"]) == 2
    assert "--force replaces only an engine directory" in capsys.readouterr().err
    assert (sorted(p.name for p in out.iterdir()) if out.is_dir() else out.read_text()) == before


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd.safetensors", "sub/../../x.safetensors",
                                   "model.bin"])
def test_index_shard_paths_are_confined_to_the_checkpoint(tiny_checkpoint, tmp_path, shard):
    src = _copy(tiny_checkpoint("glm_fsfs_sparse"), tmp_path)
    weights = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {name: shard for name in weights}}))
    with pytest.raises(CheckpointError, match="shard"):
        _build(src, tmp_path)
    assert not (tmp_path / "out").exists()
