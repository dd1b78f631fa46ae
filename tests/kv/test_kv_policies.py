"""Policies are objects that own their decisions; engine, KV and planner configs read one registry and one set of
runtime defaults."""

from __future__ import annotations

import pytest

from dhisparse import defaults
from dhisparse.engine.config import EngineConfig
from dhisparse.errors import ConfigError
from dhisparse.kv import KVConfig
from dhisparse.kv.policies import ENGINE_POLICIES, KV_POLICIES, POLICIES, policy_named
from dhisparse_planner.workload import ServingSpec


def test_each_policy_owns_its_decisions() -> None:
    resident, hisparse, adaptive, dense = (POLICIES[n] for n in ("resident", "hisparse", "adaptive", "dense"))
    assert (resident.uses_host, resident.hot_cache, resident.tail_first_page(100, 16)) == (False, False, 0)
    assert (hisparse.uses_host, hisparse.hot_cache, hisparse.reclaims, hisparse.refills) == (True, True, False, False)
    assert hisparse.optional_prompt_pages(100, 16) == 0 and hisparse.tail_first_page(100, 16) == 6
    assert (adaptive.reclaims, adaptive.refills, adaptive.optional_prompt_pages(100, 16)) == (True, True, 6)
    assert dense.reference_store and not any(POLICIES[n].reference_store for n in KV_POLICIES)
    assert set(ENGINE_POLICIES) == set(KV_POLICIES) | {"dense"}
    assert "hisparse" in resident.admission_hint and hisparse.admission_hint == ""


def test_unknown_policies_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="kv_policy must be one of resident, hisparse, adaptive, dense"):
        EngineConfig(kv_policy="lru")
    with pytest.raises(ConfigError, match="kv policy must be one of resident, hisparse, adaptive, got 'dense'"):
        KVConfig(policy="dense")  # the reference store is not the hierarchy's
    with pytest.raises(ValueError, match="ServingSpec.policy"):
        ServingSpec(policy="lru")
    with pytest.raises(ConfigError, match="my field"):
        policy_named("x", "my field")


def test_runtime_defaults_have_one_source() -> None:
    engine, kv, serving = EngineConfig(), KVConfig(), ServingSpec()
    for name in ("page_rows", "hot_rows", "refill_pages_per_step", "reserve_bytes"):
        assert getattr(engine, name) == getattr(kv, name) == getattr(serving, name) == getattr(defaults, name.upper())
    assert str(engine.kv_policy) == str(kv.policy) == str(serving.policy) == defaults.KV_POLICY
    assert engine.num_draft_tokens == defaults.NUM_DRAFT_TOKENS
