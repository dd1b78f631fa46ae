"""Per-request processing tables: built once per request (not every step), dropped with it, and exact for batches
whose rows have bad-word lists, stop sets and biases of different sizes (random cases against transformers' logits
processors, plain and over a speculative window)."""

from __future__ import annotations

import gc

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_processing import reference_process

from dhisparse.sampling import LogitsProcessor, SamplingParams
from dhisparse.sampling import request_tables as tables

VOCAB = 30
EOS = 3
CPU = torch.device("cpu")

_word = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4).map(tuple)
_params = st.builds(
    SamplingParams,
    bad_words=st.lists(_word, max_size=7).map(tuple),
    min_tokens=st.integers(0, 3),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=3).map(tuple),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-3, 3), max_size=4),
)
_sequence = st.tuples(st.lists(st.integers(0, 12), min_size=1, max_size=8),
                      st.lists(st.integers(0, 12), max_size=5))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(_params, _sequence), min_size=1, max_size=5), st.integers(0, 2**31 - 1))
def test_rows_of_different_table_sizes_equal_the_reference(rows, seed) -> None:
    params = [p for p, _ in rows]
    batch = [s for _, s in rows]
    logits = torch.randn(len(rows), 1, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    processor = LogitsProcessor.build(params, batch, [None] * len(rows), (EOS,), VOCAB, CPU)
    out = processor.apply(logits)[:, 0] if processor is not None else logits[:, 0]
    for row, (p, (prompt, output)) in enumerate(rows):
        expected = reference_process(logits[row, 0], prompt + output, len(prompt), p, (EOS,)) \
            if p.processes_logits else logits[row, 0]
        assert torch.equal(out[row], expected), (row, p)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(_params, _sequence), min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_a_speculative_window_equals_the_plain_path_with_mixed_rows(rows, seed) -> None:
    params = [p for p, _ in rows]
    batch = [s for _, s in rows]
    g = torch.Generator().manual_seed(seed)
    q = 4
    draft = torch.randint(0, 12, (len(rows), q - 1), generator=g)
    logits = torch.randn(len(rows), q, VOCAB, generator=g)
    window = LogitsProcessor.build(params, batch, [None] * len(rows), (EOS,), VOCAB, CPU)
    if window is None:
        return
    out = window.apply(logits, draft)
    for i in range(q):
        grown = [(p, o + draft[b, :i].tolist()) for b, (p, o) in enumerate(batch)]
        plain = LogitsProcessor.build(params, grown, [None] * len(rows), (EOS,), VOCAB, CPU)
        assert torch.equal(out[:, i], plain.apply(logits[:, i:i + 1])[:, 0]), i


def test_tables_are_built_once_per_request_and_dropped_with_it() -> None:
    words = tuple((i % VOCAB, (i * 7) % VOCAB) for i in range(2000))
    params = SamplingParams(bad_words=words, min_tokens=2, logit_bias={4: 1.0})
    first = tables.tables_of(params)
    prefix, last = first.bad_word_tensors(CPU)
    stops, bias = first.stop_ids((EOS,), CPU), first.bias(VOCAB, CPU)
    for step in range(3):  # later steps reuse the very same tensors: nothing is rebuilt
        LogitsProcessor.build([params], [([1, 2], [5] * step)], [None], (EOS,), VOCAB, CPU)
        again = tables.tables_of(params)
        assert again is first
        assert again.bad_word_tensors(CPU)[0] is prefix and again.bad_word_tensors(CPU)[1] is last
        assert again.stop_ids((EOS,), CPU) is stops and again.bias(VOCAB, CPU) is bias
    assert prefix.shape == (2000, 1)
    key = id(params)
    del params, first, again
    gc.collect()
    assert key not in tables._TABLES  # a finished request's tables go with its parameters
