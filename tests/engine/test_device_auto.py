"""``device="auto"``: the GPU when torch sees one, else the CPU — for LLM (via runtime.json's default), the Triton
model configuration (KIND_GPU / KIND_CPU), and clear errors for names that are not devices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dhisparse.device import resolve_device, triton_instance_group
from dhisparse.engine.config import EngineConfig
from dhisparse.errors import ConfigError
from dhisparse.serving.repository import RepositorySpec, fill_model_repository


def test_auto_is_the_gpu_when_one_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig().device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1) and resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["gpu", "mps", "", "cuda:x"])
def test_a_name_that_is_not_a_device_is_refused_by_name(name: str) -> None:
    with pytest.raises(ConfigError, match="device must be 'auto', 'cpu' or 'cuda"):
        resolve_device(name)


def test_llm_default_runs_where_auto_points(tiny_engine) -> None:
    from dhisparse import LLM

    llm = LLM(tiny_engine("glm_fsfs_sparse", "float32"))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert llm.config.device == "auto" and llm.engine.model.device.type == expected


def test_triton_instance_kind_follows_the_engine_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "runtime.json").write_text(EngineConfig().to_json())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fill_model_repository(RepositorySpec(engine), tmp_path / "cpu", models=("dhisparse",))
    assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in (tmp_path / "cpu/dhisparse/config.pbtxt").read_text()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # auto on a GPU machine
    fill_model_repository(RepositorySpec(engine), tmp_path / "gpu", models=("dhisparse",))
    assert "kind: KIND_GPU gpus: [ 0 ]" in (tmp_path / "gpu/dhisparse/config.pbtxt").read_text()
    spec = RepositorySpec(engine, engine_overrides={"device": "cuda:1"})
    assert spec.engine_device == torch.device("cuda", 1)
    assert triton_instance_group(spec.engine_device) == "[ { count: 1 kind: KIND_GPU gpus: [ 1 ] } ]"
    assert RepositorySpec(engine, engine_overrides={"device": "cpu"}).values()["engine_instance_group"] == (
        "[ { count: 1 kind: KIND_CPU } ]")
