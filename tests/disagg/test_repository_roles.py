"""The disaggregated repository per role (one server, or one server per role on two hosts) and its CLI flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dhisparse.serving.cli import _disaggregated_options, parse_args
from dhisparse.serving.disagg_repository import DisaggregatedOptions, fill_disaggregated_repository
from dhisparse.serving.repository import RepositorySpec


@pytest.fixture
def spec(tmp_path: Path) -> RepositorySpec:
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "tokenizer.json").write_text("{}")  # the text models are filled only with a tokenizer
    return RepositorySpec(engine, {"kv_policy": "adaptive"})


def _parameter(config: Path, key: str) -> str:
    text = config.read_text()
    marker = f'key: "{key}" value: {{ string_value: "'
    assert text.count(marker) == 1, f"{key} set {text.count(marker)} times in {config}"
    return text.split(marker, 1)[1].split('"', 1)[0]


def test_each_role_fills_its_models_and_parameters(spec: RepositorySpec, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)  # auto: the interface of the address
    both = fill_disaggregated_repository(spec, tmp_path / "both")
    assert set(both) == {"context", "generation", "disaggregated_serving_bls", "preprocessing", "postprocessing",
                         "ensemble"}
    assert _parameter(tmp_path / "both" / "disaggregated_serving_bls" / "config.pbtxt", "context_url") == ""

    # one key for the whole deployment: a fresh one in the repository (mode 0600, never a parameter value)
    key = Path(_parameter(tmp_path / "both" / "context" / "config.pbtxt", "auth_key_file"))
    assert key.parent == tmp_path / "both" / ".dhisparse" and key.stat().st_mode & 0o077 == 0
    assert {_parameter(tmp_path / "both" / m / "config.pbtxt", "auth_key_file")
            for m in ("context", "generation", "disaggregated_serving_bls")} == {str(key)}
    assert _parameter(tmp_path / "both" / "context" / "config.pbtxt", "nixl.ucx_net_devices") == "lo"  # loopback
    assert _parameter(tmp_path / "both" / "generation" / "config.pbtxt", "nixl.ucx_net_devices") == "lo"

    with pytest.raises(ValueError, match="share one key file"):  # two hosts: the operator gives both the same key
        fill_disaggregated_repository(spec, tmp_path / "a", None, DisaggregatedOptions("context"))
    spec = dataclasses.replace(spec, auth_key_file=key)
    options = DisaggregatedOptions("context", nixl_agent_name="host-a", hold_timeout_s=90, arena_limit_bytes=1 << 24,
                                   address="0.0.0.0")
    assert fill_disaggregated_repository(spec, tmp_path / "a", None, options) == ["context"]
    assert _parameter(tmp_path / "a" / "context" / "config.pbtxt", "nixl.agent_name") == "host-a-context"
    assert _parameter(tmp_path / "a" / "context" / "config.pbtxt", "nixl.hold_timeout_s") == "90"
    assert _parameter(tmp_path / "a" / "context" / "config.pbtxt", "nixl.arena_limit_bytes") == str(1 << 24)
    assert _parameter(tmp_path / "a" / "context" / "config.pbtxt", "nixl.ucx_net_devices") == ""  # every interface
    assert _parameter(tmp_path / "a" / "context" / "config.pbtxt", "auth_key_file") == str(key)

    options = DisaggregatedOptions("generation", "10.0.0.1:8001", "host-b", transfer_timeout_s=5)
    models = fill_disaggregated_repository(spec, tmp_path / "b", None, options)
    assert "context" not in models and {"generation", "disaggregated_serving_bls", "ensemble"} <= set(models)
    b = tmp_path / "b"
    assert _parameter(b / "disaggregated_serving_bls" / "config.pbtxt", "context_url") == "10.0.0.1:8001"
    assert _parameter(b / "generation" / "config.pbtxt", "nixl.agent_name") == "host-b-generation"
    assert _parameter(b / "generation" / "config.pbtxt", "nixl.transfer_timeout_s") == "5"
    assert 'model_name: "disaggregated_serving_bls"' in (b / "ensemble" / "config.pbtxt").read_text()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"role": "prefill"}, "role"),
    ({"role": "generation"}, "context_url"),
    ({"role": "both", "context_url": "a:1"}, "context_url"),
    ({"role": "generation", "context_url": "no-port"}, "context_url"),
    ({"nixl_agent_name": "a b"}, "nixl_agent_name"),
    ({"hold_timeout_s": 0}, "hold_timeout_s"),
    ({"arena_limit_bytes": 1000}, "arena_limit_bytes"),
    ({"ucx_net_devices": "lo; rm"}, "ucx_net_devices"),
    ({"address": "192.0.2.254"}, "ucx-net-devices"),
])
def test_bad_options_are_refused_by_name(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DisaggregatedOptions(**kwargs)


def test_cli_flags_map_to_the_options() -> None:
    assert _disaggregated_options(parse_args(["--engine", "E"])) is None
    assert _disaggregated_options(parse_args(["--engine", "E", "--disaggregated"])) == DisaggregatedOptions()
    options = _disaggregated_options(parse_args(["--engine", "E", "--role", "generation", "--context-url",
                                                 "10.0.0.1:8001", "--nixl-agent-name", "b",
                                                 "--nixl-transfer-timeout", "7", "--nixl-hold-timeout", "9"]))
    assert options == DisaggregatedOptions("generation", "10.0.0.1:8001", "b", 7.0, 9.0)
    with pytest.raises(ValueError, match="--context-url"):
        _disaggregated_options(parse_args(["--engine", "E", "--context-url", "a:1"]))


def test_unreachable_context_server_is_a_clear_error() -> None:
    import numpy as np

    pytest.importorskip("tritonclient.grpc", reason="tritonclient (the serve extra) is not installed")

    from dhisparse.disagg.context_client import ContextPhaseError, RemoteContext
    from dhisparse.serving.server import free_ports

    (port,) = free_ports(1)
    context = RemoteContext(f"127.0.0.1:{port}")
    try:
        with pytest.raises(ContextPhaseError, match=f"context server 127.0.0.1:{port}"):
            context.call({"input_lengths": np.array([[1]], dtype=np.int32)}, "r0")
    finally:
        context.close()
    with pytest.raises(ValueError, match="context_url"):
        RemoteContext("no-port")
