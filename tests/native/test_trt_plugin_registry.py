"""The TensorRT plugin library loads into ``tensorrt_lean``'s plugin registry and behaves, without a GPU.

TensorRT's Python bindings cannot call the build-time methods of C++ plugins (output types and shapes,
formats, fields to serialize: "not available to be called from Python on C++-based plugins"), so those are
checked by the C++ harness ``tests/native/cpp/test_plugin_contract.cpp`` (also a ctest), run here as well.
Engines are never deserialized (that segfaults without a GPU).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

trt = pytest.importorskip("tensorrt_lean", reason="tensorrt-lean is not installed")

BUILD = Path(__file__).resolve().parents[2] / "build" / "native"
LIBRARY = BUILD / "plugins" / "tensorrt" / "libdhisparse_trt_plugins.so"
HARNESS = BUILD / "tests" / "native" / "cpp" / "test_plugin_contract"
NAMESPACE = "dhisparse"

pytestmark = pytest.mark.skipif(
    not LIBRARY.is_file(), reason=f"plugin library not built ({LIBRARY}); run scripts/setup_native.sh"
)

INT32, FLOAT32 = trt.PluginFieldType.INT32, trt.PluginFieldType.FLOAT32
EXPECTED_FIELDS = {
    "DhsResolver": [("page_rows", INT32)],
    "DhsRowCopy": [("row_bytes", INT32)],
    "DhsSparseMla": [
        ("kv_lora_rank", INT32),
        ("qk_rope_head_dim", INT32),
        ("kv_format", INT32),
        ("softmax_scale", FLOAT32),
    ],
}
VALID = {
    "DhsResolver": {"page_rows": 64},
    "DhsRowCopy": {"row_bytes": 656},
    "DhsSparseMla": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "kv_format": 2, "softmax_scale": 0.1352},
}
INVALID = {
    "DhsResolver": {"page_rows": 0},
    "DhsRowCopy": {"row_bytes": -4},
    "DhsSparseMla": {"kv_lora_rank": 256, "qk_rope_head_dim": 64, "kv_format": 2, "softmax_scale": 0.1},
}
NUM_OUTPUTS = {"DhsResolver": 8, "DhsRowCopy": 1, "DhsSparseMla": 1}


def fields(values: dict[str, float]) -> trt.PluginFieldCollection:
    """A field collection: int values as int32, float values as float32 scalars."""
    out = []
    for name, value in values.items():
        if isinstance(value, int):
            out.append(trt.PluginField(name, np.array([value], np.int32), INT32))
        else:
            out.append(trt.PluginField(name, np.array([value], np.float32), FLOAT32))
    return trt.PluginFieldCollection(out)


@pytest.fixture(scope="module")
def registry() -> Iterator[trt.IPluginRegistry]:
    reg = trt.get_plugin_registry()
    handle = reg.load_library(str(LIBRARY))
    assert handle is not None, "load_library failed (getCreators / setLoggerFinder not exported?)"
    yield reg
    reg.deregister_library(handle)


@pytest.mark.parametrize("name", sorted(EXPECTED_FIELDS))
def test_creator_is_registered_with_its_fields(registry: trt.IPluginRegistry, name: str) -> None:
    creator = registry.get_creator(name, "1", NAMESPACE)
    assert creator is not None
    assert isinstance(creator, trt.IPluginCreatorV3One)
    assert (creator.name, creator.plugin_version, creator.plugin_namespace) == (name, "1", NAMESPACE)
    assert [(f.name, f.type) for f in creator.field_names] == EXPECTED_FIELDS[name]
    assert registry.get_creator(name, "2", NAMESPACE) is None


@pytest.mark.parametrize("name", sorted(EXPECTED_FIELDS))
@pytest.mark.parametrize("phase", ["BUILD", "RUNTIME"])
def test_create_plugin_in_both_phases(registry: trt.IPluginRegistry, name: str, phase: str) -> None:
    creator = registry.get_creator(name, "1", NAMESPACE)
    plugin = creator.create_plugin("layer", fields(VALID[name]), getattr(trt.TensorRTPhase, phase))
    assert isinstance(plugin, trt.IPluginV3)
    core = plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
    assert (core.plugin_name, core.plugin_version, core.plugin_namespace) == (name, "1", NAMESPACE)
    build = plugin.get_capability_interface(trt.PluginCapabilityType.BUILD)
    assert build.num_outputs == NUM_OUTPUTS[name]
    runtime = plugin.get_capability_interface(trt.PluginCapabilityType.RUNTIME)
    assert runtime.interface_info.kind == "PLUGIN_V3ONE_RUNTIME"


def test_row_copy_declares_the_in_place_build_interface(registry: trt.IPluginRegistry) -> None:
    plugin = registry.get_creator("DhsRowCopy", "1", NAMESPACE).create_plugin(
        "copy", fields(VALID["DhsRowCopy"]), trt.TensorRTPhase.BUILD
    )
    info = plugin.get_capability_interface(trt.PluginCapabilityType.BUILD).interface_info
    assert (info.kind, info.major) == ("PLUGIN_V3ONE_BUILD", 2)  # IPluginV3OneBuildV2: getAliasedInput


@pytest.mark.parametrize("name", sorted(EXPECTED_FIELDS))
def test_invalid_fields_are_refused(registry: trt.IPluginRegistry, name: str) -> None:
    creator = registry.get_creator(name, "1", NAMESPACE)
    assert creator.create_plugin("bad", fields(INVALID[name]), trt.TensorRTPhase.BUILD) is None


@pytest.mark.skipif(not HARNESS.is_file(), reason=f"contract harness not built ({HARNESS})")
def test_shapes_types_formats_and_serialization_round_trip() -> None:
    """Output shapes/types, supported formats, configuration checks, aliasing, field round trip (C++)."""
    done = subprocess.run(
        [str(HARNESS), str(LIBRARY)], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "all checks passed" in done.stdout
