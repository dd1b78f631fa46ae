"""One table of defaults (``dhisparse/defaults.py``): every config, CLI, ``runtime.json`` and the planner agree with it.
And the engine-wide statistics agree with per-request accounting."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tiny_models import build_spec_engine, random_prompts

from dhisparse import LLM, SamplingParams, defaults
from dhisparse.engine.config import EngineConfig
from dhisparse.kv.config import KVConfig
from dhisparse_planner.workload import ServingSpec


def _table_value(name: str) -> object:
    return getattr(defaults, name.upper())


def test_engine_config_defaults_are_the_table() -> None:
    config = EngineConfig()
    for field in dataclasses.fields(EngineConfig):
        value = getattr(config, field.name)
        value = value.name if field.name == "kv_policy" else value
        assert value == _table_value(field.name), field.name


def test_kv_config_defaults_are_the_table() -> None:
    config = KVConfig()
    assert config.kv_policy.name == defaults.KV_POLICY
    shared = ("pool_bytes", "hot_rows", "page_rows", "reserve_bytes", "refill_pages_per_step", "host_bytes",
              "max_batch_size", "max_model_len")
    for name in shared:
        assert getattr(config, name) == _table_value(name), name
    # what the engine builds from its own configuration is the same table
    built = EngineConfig().kv_config(1, 0, defaults.MAX_MODEL_LEN)
    for name in shared:
        assert getattr(built, name) == getattr(config, name), name


def test_planner_serving_spec_defaults_are_the_table() -> None:
    spec = ServingSpec()
    for name in ("hot_rows", "page_rows", "refill_pages_per_step"):
        assert getattr(spec, name) == _table_value(name), name
    assert str(spec.policy) == defaults.KV_POLICY and spec.reserve_bytes == defaults.RESERVE_BYTES


@pytest.mark.parametrize("cli", ["serve", "build"])
def test_cli_engine_options_default_to_the_engine_directory(cli) -> None:
    """The CLIs' engine options default to "unset" (the engine directory's runtime.json, itself the table) or to
    the table's own value."""
    if cli == "serve":
        from dhisparse.serving.cli import parse_args

        args = parse_args(["--engine", "x"])
    else:
        from dhisparse_builder.cli import parse_args

        args = parse_args(["--checkpoint", "x", "--output", "y"])
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    checked = 0
    for name, value in vars(args).items():
        if name in names:
            checked += 1
            assert value is None or value == _table_value(name), (cli, name, value)
    assert checked >= 8


def test_runtime_json_of_a_built_engine_is_the_table(tiny_engine) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    written = json.loads((engine_dir / "runtime.json").read_text())
    for name, value in written.items():
        if name == "dtype":
            continue  # the build's own choice
        assert value == _table_value(name), name


def test_engine_wide_staging_figure_is_what_each_request_is_charged(tiny_checkpoint, tmp_path) -> None:
    """``spec_staging_bytes_per_request`` (engine-wide) is the mean of the requests' ``kv_staging_bytes`` (the
    overflow rows and the verification block's provisional rows, not the overflow alone), and the engine's total
    staging charge is the sum of theirs."""
    engine_dir = build_spec_engine(tmp_path, tiny_checkpoint("glm_fsfs_sparse"))
    llm = LLM(engine_dir, kv_policy="adaptive", speculative="dflash2", page_rows=16)
    outs = llm.generate(random_prompts([40, 71], 96, seed=2), SamplingParams(max_tokens=6, ignore_eos=True))
    per_request = [o.stats["kv_staging_bytes"] for o in outs]
    stats = llm.stats()
    assert stats["kv_staging_bytes_charged"] == sum(per_request)
    assert stats["spec_staging_bytes_per_request"] == round(sum(per_request) / len(per_request))
    assert min(per_request) > llm.engine.kv.footprint(1, 1).staging_overflow_bytes
    assert {o.stats["kv_ring_bytes"] for o in outs} == {stats["spec_ring_bytes_per_request"]}
