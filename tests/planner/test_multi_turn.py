"""The planner's prefix-reuse model for multi-turn chat (``dhisparse_planner.multi_turn``, issue 26)."""

from __future__ import annotations

import dataclasses

import pytest

from dhisparse_planner.cli import main
from dhisparse_planner.multi_turn import (
    MultiTurnResult,
    MultiTurnSpec,
    cached_page_bytes,
    per_turn,
    prefill_chunk_seconds,
    simulate_multi_turn,
    with_reuse,
)
from dhisparse_planner.specs import GLM5, H200
from dhisparse_planner.timing import prefill_seconds

# small real-token workload on GLM-5: 4 clients x 2 sessions x 5 turns, short replies (seconds to simulate)
BASE = MultiTurnSpec(2048, 256, reply_tokens=64, turns=5, clients=4, sessions_per_client=2)
PAGE_BYTES = cached_page_bytes(GLM5, BASE.page_rows)
NEED = -(-(BASE.prompt(BASE.turns) + BASE.reply_tokens) // BASE.page_rows)  # host pages of the largest turn


def hit_rate(r: MultiTurnResult) -> float:
    return sum(t.reused for t in r.turns) / sum(t.prompt for t in r.turns)


def mean_ttft(r: MultiTurnResult) -> float:
    return sum(t.ttft_s for t in r.turns) / len(r.turns)


def host(requests: float) -> float:
    return requests * NEED * PAGE_BYTES


def test_chunks_add_up_to_the_whole_prefill() -> None:
    whole = prefill_chunk_seconds(H200, GLM5, 0, 32768)
    parts = sum(prefill_chunk_seconds(H200, GLM5, a, a + 4096) for a in range(0, 32768, 4096))
    assert parts == pytest.approx(whole, rel=1e-12)
    # the planner's whole-prompt prefill counts T * min(topk, T) attended rows; per position is slightly less
    assert whole == pytest.approx(prefill_seconds(H200, GLM5, 32768), rel=0.01)
    assert whole < prefill_seconds(H200, GLM5, 32768)
    # a suffix after a long cached prefix costs more than the same tokens at the start (its queries see more keys)
    assert prefill_chunk_seconds(H200, GLM5, 65536, 66560) > prefill_chunk_seconds(H200, GLM5, 0, 1024)


@pytest.mark.parametrize("reply,turn_tokens", [(65, 63), (64, 256), (100, 1000)])
def test_everything_cached_prefills_only_the_new_tokens(reply: int, turn_tokens: int) -> None:
    spec = dataclasses.replace(BASE, reply_tokens=reply, turn_tokens=turn_tokens)
    r = simulate_multi_turn(H200, GLM5, spec)
    assert r.evicted_pages == 0
    page = spec.page_rows
    for t in r.turns:
        if t.turn == 1:
            assert t.reused == 0
            continue
        written = spec.prompt(t.turn - 1) + reply - 1  # the last reply token is never fed back
        assert t.reused == written // page * page
        assert t.prompt - t.reused == turn_tokens + 1 + written % page  # message + last reply token + partial page
    if (reply - 1) % page == 0:  # history on the page grid: exactly the new message and the last reply token
        assert all(row["prefill_tokens"] == turn_tokens + 1 for row in per_turn(r)[1:])
    off = simulate_multi_turn(H200, GLM5, with_reuse(spec, False))
    assert all(t.reused == 0 for t in off.turns)
    a, b = per_turn(off), per_turn(r)
    first = [(t.client, t.ttft_s) for t in off.turns if t.turn == 1 and t.session % spec.sessions_per_client == 0]
    assert sorted(first) == sorted((t.client, t.ttft_s) for t in r.turns  # the first wave: misses, same lane
                                   if t.turn == 1 and t.session % spec.sessions_per_client == 0)
    assert all(y["mean_ttft_s"] < x["mean_ttft_s"] for x, y in zip(a[1:], b[1:], strict=True))


def test_window_is_never_reused() -> None:
    spec = dataclasses.replace(BASE, reply_tokens=65, turn_tokens=63, window=128)
    r = simulate_multi_turn(H200, GLM5, spec)
    assert all(t.prompt - t.reused >= 128 for t in r.turns)


def test_host_too_small_for_the_history_converges_to_no_reuse() -> None:
    hits, ratios = [], []
    for requests in (1.0, 2.0, 3.0, 4.0, 8.0):
        spec = dataclasses.replace(BASE, host_bytes=host(requests))
        on, off = simulate_multi_turn(H200, GLM5, spec), simulate_multi_turn(H200, GLM5, with_reuse(spec, False))
        hits.append(hit_rate(on))
        ratios.append(mean_ttft(off) / mean_ttft(on))
    assert hits[0] == 0.0 and ratios[0] == pytest.approx(1.0, rel=1e-9)  # room for one request: every page evicted
    assert hits[-1] > 0.7 and ratios[-1] > 1.5
    assert hits == sorted(hits)


def test_cached_pages_stay_within_the_host_store() -> None:
    spec = dataclasses.replace(BASE, host_bytes=host(2.5))
    r = simulate_multi_turn(H200, GLM5, spec)
    assert r.evicted_pages > 0
    assert r.cached_bytes_max <= r.host_pages * PAGE_BYTES


@pytest.mark.parametrize("think_s", [0.0, 1.0])
def test_more_host_capacity_never_lowers_the_hit_rate(think_s: float) -> None:
    """Metamorphic: growing the host store never lowers the hit rate (clients beyond what fits wait, and their
    idle histories compete with the running requests' pages)."""
    spec = dataclasses.replace(BASE, think_s=think_s)
    hits = [hit_rate(simulate_multi_turn(H200, GLM5, dataclasses.replace(spec, host_bytes=host(k))))
            for k in (1.0, 1.7, 2.2, 2.6, 3.0, 3.3, 3.7, 4.5, 6.0)]
    assert hits == sorted(hits), hits
    assert hits[0] < hits[-1]


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="turn_tokens"):
        MultiTurnSpec(1024, 0)
    with pytest.raises(ValueError, match="host_bytes"):
        MultiTurnSpec(1024, 64, host_bytes=-1)
    with pytest.raises(RuntimeError, match="host store is smaller"):
        simulate_multi_turn(H200, GLM5, dataclasses.replace(BASE, host_bytes=PAGE_BYTES * 3))


def test_cli_writes_the_table(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert main(["multi-turn", "--context", "2048", "--turn-tokens", "256", "--reply-tokens", "64", "--turns", "3",
                 "--clients", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ttft_ratio" in out
    lines = (tmp_path / "multi_turn.csv").read_text().splitlines()
    assert len(lines) == 1 + 3 and lines[0].startswith("context,turn_tokens")
    assert "dhisparse-plan multi-turn --context 2048" in (tmp_path / "multi_turn.md").read_text()
    assert main(["multi-turn", "--context", "0"]) == 2


def test_reuse_on_and_off_draw_the_same_think_times() -> None:
    spec = dataclasses.replace(BASE, think_s=2.0, seed=3)
    on, off = simulate_multi_turn(H200, GLM5, spec), simulate_multi_turn(H200, GLM5, with_reuse(spec, False))

    def gaps(r: MultiTurnResult) -> dict[tuple[int, int], float]:
        done = {(t.session, t.turn): t.finish_s or 0.0 for t in r.turns}
        return {(t.session, t.turn): t.arrival_s - done[(t.session, t.turn - 1)] for t in r.turns if t.turn > 1}

    a, b = gaps(off), gaps(on)
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], abs=1e-9) for k in a)
    assert len(set(round(v, 6) for v in a.values())) > len(a) // 2  # drawn, not one constant
