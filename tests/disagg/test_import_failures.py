"""Any failure of an import fails that one request, never the decode engine.

Params that passed the trust boundary but do not fit (as a buggy or compromised context role could send: they are
made here from genuine ones, below the signature check) are imported by a real decode engine over real NIXL:
every one ends its request with an error (or is refused when added), the engine stays alive, its invariants hold,
and a genuine request afterwards gets the co-located reference's tokens. ``trust.check_context`` refuses every
such case before the engine sees it (last test).
"""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import random_prompts

from dhisparse import LLM, SamplingParams
from dhisparse.errors import InvalidRequestError

pytest.importorskip("nixl._api", reason="NIXL (nixl==1.5.1) is not installed")

from dhisparse.disagg.decode import load_decode_engine
from dhisparse.disagg.nixl_transfer import NixlExporter, NixlImporter
from dhisparse.disagg.prefill import PrefillEngine, PrefillService
from dhisparse.disagg.trust import check_context

PROMPTS = random_prompts([13, 21], 96, seed=7)
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _layout(**changes):
    return lambda c: dataclasses.replace(c, layout=dataclasses.replace(c.layout, **changes))


def _crafted(context):
    layout = context.layout
    return {
        "rows_dtype float64": _layout(rows_dtype="float64")(context),
        "rows_dtype bfloat16": _layout(rows_dtype="bfloat16")(context),
        "row_dim + 1": _layout(row_dim=layout.row_dim + 1)(context),
        "num_sources + 1": _layout(num_sources=layout.num_sources + 1)(context),
        "one key layer": _layout(key_layers=layout.key_layers[:1])(context),
        "index_key_dim + 8": _layout(index_key_dim=layout.index_key_dim + 8)(context),
        "features": _layout(feature_rows=4, feature_dim=8)(context),
        "region_addr + 1 GiB": dataclasses.replace(context, region_addr=context.region_addr + (1 << 30)),
        "first token outside": dataclasses.replace(context, first_token=10**6),
    }


def _run(engine, prompt, context, request_id):
    """Add and step until the request ends; its finish reason (``refused`` when adding it raised)."""
    try:
        engine.add_imported_request(prompt, PARAMS, context, request_id)
    except InvalidRequestError:
        return "refused"
    for _ in range(2000):
        for update in engine.step():
            if update.request_id == request_id and update.finished:
                engine.requests.pop(request_id, None)
                return update.finish_reason
    raise AssertionError(f"{request_id} never finished")


@pytest.mark.parametrize("policy", ["adaptive", "dense"])
def test_every_bad_import_fails_its_request_and_the_engine_lives(tiny_engine, policy) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    service = PrefillService(PrefillEngine(engine_dir), NixlExporter(f"import-ctx-{policy}", hold_timeout_s=60.0))
    engine = load_decode_engine(engine_dir, NixlImporter(f"import-dec-{policy}", timeout_s=10.0), kv_policy=policy,
                                page_rows=4, pool_bytes=1 << 24)
    try:
        genuine = service.run(PROMPTS[0], PARAMS, "genuine-0")
        outcomes = {}
        for i, (name, crafted) in enumerate(_crafted(genuine).items()):
            fresh = service.run(PROMPTS[0], PARAMS, f"victim-{i}")  # a live region for each attempt
            crafted = dataclasses.replace(crafted, request_key=fresh.request_key, region_addr=crafted.region_addr
                                          - genuine.region_addr + fresh.region_addr)
            outcomes[name] = _run(engine, PROMPTS[0], crafted, f"bad-{i}")
            assert engine.dead is None, (name, engine.dead)
            engine.kv.check_invariants()
        assert all(reason in ("error", "refused") for reason in outcomes.values()), outcomes
        expected = LLM(engine_dir, kv_policy="dense").generate([PROMPTS[1]], PARAMS)[0].token_ids
        context = service.run(PROMPTS[1], PARAMS, "after")
        engine.add_imported_request(PROMPTS[1], PARAMS, context, "after")
        tokens = []
        while engine.has_unfinished():
            tokens += [t for u in engine.step() if u.request_id == "after" for t in u.new_token_ids]
        assert tokens == expected
    finally:
        engine.importer.close()
        service.close()


def test_the_trust_check_refuses_every_crafted_case(tiny_engine) -> None:
    engine_dir = tiny_engine("glm_fsfs_sparse", "float32")
    service = PrefillService(PrefillEngine(engine_dir), NixlExporter("trust-ctx", hold_timeout_s=60.0))
    engine = load_decode_engine(engine_dir, NixlImporter("trust-dec", timeout_s=10.0), kv_policy="adaptive",
                                page_rows=4, pool_bytes=1 << 24)
    try:
        genuine = service.run(PROMPTS[0], PARAMS, "genuine")
        check_context(genuine, engine.layout_template, PROMPTS[0])  # the genuine params pass
        for name, crafted in _crafted(genuine).items():
            if name == "region_addr + 1 GiB":
                continue  # only the signature vouches for the address (tests/disagg/test_params.py)
            with pytest.raises(InvalidRequestError, match="context_phase_params"):
                check_context(crafted, engine.layout_template, PROMPTS[0])
        with pytest.raises(InvalidRequestError, match="another prompt"):
            check_context(genuine, engine.layout_template, [(t + 1) % 300 for t in PROMPTS[0]])
    finally:
        engine.importer.close()
        service.close()
