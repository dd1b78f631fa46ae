"""The planner simulates what the engine runs by default: its serving, speculation and CLI defaults are the engine's
(``dhisparse.defaults`` / ``EngineConfig``); a scenario that models another setup names its values instead."""

from __future__ import annotations

from dhisparse.engine.config import EngineConfig
from dhisparse_planner import paper
from dhisparse_planner.cli import build_parser
from dhisparse_planner.speculation import SpeculationModel
from dhisparse_planner.workload import ServingSpec


def test_serving_and_speculation_defaults_are_the_engines() -> None:
    engine, serving, spec = EngineConfig(), ServingSpec(), SpeculationModel()
    for name in ("max_batch_size", "max_prefill_tokens_per_step", "page_rows", "hot_rows", "reserve_bytes",
                 "refill_pages_per_step"):
        assert getattr(serving, name) == getattr(engine, name), name
    assert serving.policy == engine.kv_policy.name
    assert spec.gamma == engine.num_draft_tokens
    assert spec.busy_batch == engine.dspark_busy_batch
    assert spec.min_confidence == engine.dspark_busy_confidence


def test_cli_defaults_are_the_engines() -> None:
    args, engine = build_parser().parse_args([]), EngineConfig()
    assert (args.max_batch_size, args.max_prefill_tokens_per_step, args.hot_rows, args.page_rows, args.gamma,
            args.busy_batch) == (engine.max_batch_size, engine.max_prefill_tokens_per_step, engine.hot_rows,
                                 engine.page_rows, engine.num_draft_tokens, engine.dspark_busy_batch)


def test_the_paper_scenario_names_what_it_changes() -> None:
    assert paper.BASE.max_batch_size == paper.PAPER_MAX_RUNNING_REQUESTS >= 128  # the paper's C128 runs at once
    assert paper.BASE.max_prefill_tokens_per_step == paper.PAPER_PREFILL_TOKENS_PER_STEP
    assert paper.BASE.hot_rows == paper.PAPER_HOT_ROWS
