"""Our responses parsed exactly the way tensorrtllm_backend's `end_to_end_grpc_client.py` parses them.

That client (the last tensorrtllm_backend revision with `inflight_batcher_llm/client/`, before #745) opens a gRPC
stream, sends one request without asking for an empty final response, closes the stream (`stop_stream` waits for
every response) and then reads each result with strict expectations of the shapes:

- ``result.as_numpy("text_output")[0].decode("utf-8")``: text_output is one string per sequence (1-D) and valid UTF-8;
  streaming appends each chunk, otherwise the response holds the whole text (prompt first unless
  ``exclude_input_in_output``);
- ``batch_index`` / ``sequence_index``: ``None`` or ``[0][0]``; with ``--batch-inputs`` the rows of one request are
  told apart by ``batch_index``, with ``-n`` the samples by ``sequence_index``;
- ``output_log_probs`` printed with its shape; every perf metric read as ``[0][0]``.

`run_like_end_to_end_client` below does the same; the tests compare what it assembles with the offline engine. The
text test runs against the `dhisparse_bls` model too, which must return the ensemble's shapes. The `dhisparse`
model's perf metrics and `llmapi` statistics are checked where they are not zero: a prompt sent twice has its pages
reused from the prefix cache the second time.
"""

from __future__ import annotations

import queue
import uuid
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from dhisparse import SamplingParams
from dhisparse.serving.tokenization import TokenBytes

PROMPTS = ["To be, or not to be", "the slings and arrows", "naïve café"]
OUTPUT_LEN = 10
PERF_METRICS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
                "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")


def prepare_inputs(prompt: str, streaming: bool, temperature: float = 0.0, stop_words: list[str] | None = None,
                   num_return_sequences: int | None = None, exclude_input_in_output: bool = False,
                   return_log_probs: bool = False, return_perf_metrics: bool = False) -> dict[str, np.ndarray]:
    """The client's `prepare_inputs` for these options (its arrays, dtypes and the inputs it always sends)."""
    inputs = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones_like([[prompt]]).astype(np.int32) * OUTPUT_LEN,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[temperature]], dtype=np.float32),
    }
    if num_return_sequences is not None:
        inputs["num_return_sequences"] = np.array([[num_return_sequences]], dtype=np.int32)
    if stop_words:
        inputs["stop_words"] = np.array([stop_words], dtype=object)
    if return_log_probs:
        inputs["return_log_probs"] = np.array([[True]], dtype=bool)
    inputs["exclude_input_in_output"] = np.array([[exclude_input_in_output]], dtype=bool)
    if return_perf_metrics:
        inputs["return_perf_metrics"] = np.array([[True]], dtype=bool)
    return inputs


def run_like_end_to_end_client(url: str, prompts: list[str], streaming: bool, batch_inputs: bool = False,
                               num_return_sequences: int | None = None, return_log_probs: bool = False,
                               return_perf_metrics: bool = False, model: str = "ensemble",
                               **options) -> tuple[list[str], list[dict]]:
    """`run_inference` of the client (its `--model-name` is `model`): returns the texts it assembles (batch row by
    row, then sample by sample) and, per response, what it reads besides the text (log-prob shapes, perf metrics)."""
    rows = [prepare_inputs(p, streaming, num_return_sequences=num_return_sequences,
                           return_log_probs=return_log_probs, return_perf_metrics=return_perf_metrics, **options)
            for p in prompts]
    if batch_inputs:
        requests = [{key: np.concatenate([row[key] for row in rows], axis=0) for key in rows[0]}]
    else:
        requests = rows
    outputs = [grpcclient.InferRequestedOutput("text_output")]
    if return_log_probs:
        outputs += [grpcclient.InferRequestedOutput("cum_log_probs"),
                    grpcclient.InferRequestedOutput("output_log_probs")]
    if num_return_sequences is not None and num_return_sequences > 1:
        outputs.append(grpcclient.InferRequestedOutput("sequence_index"))
    if batch_inputs:
        outputs.append(grpcclient.InferRequestedOutput("batch_index"))
    if return_perf_metrics:
        outputs += [grpcclient.InferRequestedOutput(name) for name in PERF_METRICS]

    client = grpcclient.InferenceServerClient(url)
    texts: list[str] = []
    seen: list[dict] = []
    for arrays in requests:
        completed: queue.Queue = queue.Queue()

        def callback(user_data: queue.Queue, result, error) -> None:
            user_data.put(error if error else result)

        client.start_stream(callback=partial(callback, completed))
        tensors = []
        for name, value in arrays.items():
            tensor = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        client.async_stream_infer(model, tensors, outputs=outputs, request_id=uuid.uuid4().hex)
        client.stop_stream()  # waits for the server to close the stream
        generations = num_return_sequences or 1
        batch_output_text = [[""] * generations for _ in range(tensors[0].shape()[0])]
        while not completed.empty():
            result = completed.get()
            assert not isinstance(result, InferenceServerException), result
            output = result.as_numpy("text_output")
            batch_index = result.as_numpy("batch_index")
            batch_index = 0 if batch_index is None else batch_index[0][0]
            seq_index = result.as_numpy("sequence_index")
            seq_index = 0 if seq_index is None else seq_index[0][0]
            if streaming:
                batch_output_text[batch_index][seq_index] += output[0].decode("utf-8")
            else:
                batch_output_text[batch_index][seq_index] = output[0].decode("utf-8")
            read: dict = {}
            log_probs = result.as_numpy("output_log_probs")
            if log_probs is not None:
                read["output_log_probs"] = log_probs
            if return_perf_metrics:
                read.update({name: result.as_numpy(name)[0][0] for name in PERF_METRICS})
            seen.append(read)
        for row in batch_output_text:
            texts.extend(row)
    client.close()
    return texts, seen


@pytest.fixture(scope="module")
def greedy(offline_llm, tokenizer) -> dict[str, tuple[list[int], list[float], str]]:
    """prompt -> (greedy output ids, their log-probs, the text: the whole sequence decoded, invalid bytes U+FFFD)."""
    token_bytes = TokenBytes(tokenizer)
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        result = offline_llm.generate([ids], SamplingParams(max_tokens=OUTPUT_LEN, logprobs=True))[0]
        out[prompt] = (result.token_ids, result.log_probs, token_bytes.decode(result.token_ids).decode("utf-8",
                                                                                                    "replace"))
    return out


@pytest.mark.parametrize("model", ["ensemble", "dhisparse_bls"])
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("batch_inputs", [False, True])
def test_texts_as_the_client_assembles_them(served, greedy, streaming, batch_inputs, model):
    texts, _ = run_like_end_to_end_client(served.grpc_url, PROMPTS, streaming, batch_inputs, model=model)
    # the client's --check-outputs: not streaming (and the prompt not excluded), the prompt comes first
    assert texts == [(p if not streaming else "") + greedy[p][2] for p in PROMPTS]


@pytest.mark.parametrize("streaming", [False, True])
def test_two_return_sequences_parse_by_sequence_index(served, greedy, streaming):
    texts, _ = run_like_end_to_end_client(served.grpc_url, PROMPTS[:2], streaming, num_return_sequences=2,
                                          exclude_input_in_output=True)
    # greedy: both samples are the greedy text (the client lists batch row 0's samples, then row 1's)
    assert texts == [greedy[p][2] for p in PROMPTS[:2] for _ in range(2)]


@pytest.mark.parametrize("width", [1, 2])
def test_stop_words_end_the_text_after_the_stop_word(served, greedy, tokenizer, width):
    """A stop word of `width` tokens taken from the greedy output (one that encodes back to those tokens): the text
    ends right after its first occurrence (single-token words stop in the engine, longer ones in the serving
    layer)."""
    token_bytes = TokenBytes(tokenizer)
    tokens = greedy[PROMPTS[0]][0]
    for start in range(1, len(tokens) - width):
        word = token_bytes.decode(tokens[start:start + width]).decode("utf-8", "replace")
        if tokenizer.encode(word, add_special_tokens=False).ids == tokens[start:start + width]:
            break
    else:
        pytest.fail("no usable stop word in the greedy output")
    first = next(i for i in range(len(tokens)) if tokens[i:i + width] == tokens[start:start + width])
    texts, _ = run_like_end_to_end_client(served.grpc_url, PROMPTS[:1], True, stop_words=[word])
    assert texts == [token_bytes.decode(tokens[:first + width]).decode("utf-8", "replace")]
    assert len(texts[0]) < len(greedy[PROMPTS[0]][2])  # it really stopped early


def test_log_probs_and_perf_metrics_read_as_the_client_reads_them(served, greedy):
    prompt = PROMPTS[1]
    texts, seen = run_like_end_to_end_client(served.grpc_url, [prompt], False, return_log_probs=True,
                                             return_perf_metrics=True)
    assert texts == [prompt + greedy[prompt][2]]
    (read,) = seen
    assert read["output_log_probs"].shape == (1, 1, OUTPUT_LEN)
    assert np.allclose(read["output_log_probs"].reshape(-1), greedy[prompt][1], atol=1e-5)
    assert 0 < read["arrival_time_ns"] <= read["first_token_time_ns"] <= read["last_token_time_ns"]
    assert read["kv_cache_alloc_total_blocks"] >= 1 and read["total_draft_tokens"] == 0

    texts, seen = run_like_end_to_end_client(served.grpc_url, [prompt], True, return_perf_metrics=True)
    assert texts == [greedy[prompt][2]] and len(seen) > 1  # every streamed response carries the metrics
    assert [r["last_token_time_ns"] for r in seen] == sorted(r["last_token_time_ns"] for r in seen)


def test_llm_model_reports_the_llmapi_statistics_and_finish_reason(served, greedy, tokenizer):
    """tensorrtllm_backend's `llmapi` model outputs on `dhisparse`: kv_cache_hit_rate / kv_cache_reused_block /
    kv_cache_missed_block with the perf metrics, finish_reason; the same through the ensemble."""
    ids = tokenizer.encode(PROMPTS[0]).ids
    values = {"input_ids": np.array([ids], dtype=np.int32), "request_output_len": np.array([[4]], dtype=np.int32),
              "return_perf_metrics": np.array([[True]]), "return_finish_reason": np.array([[True]]),
              "streaming": np.array([[True]])}
    tensors = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    responses = list(served.client().stream_results("dhisparse", tensors))
    pages = -(-len(ids) // served.overrides["page_rows"])  # the prompt's pages, none of them cached
    for response in responses:
        assert response["kv_cache_reused_block"][0][0] == 0 and response["kv_cache_hit_rate"][0][0] == 0.0
        assert response["kv_cache_missed_block"][0][0] == pages
    assert [r["finish_reason"][0][0] for r in responses] == [b""] * (len(responses) - 1) + [b"length"]
    # return_final_perf_metrics: the same statistics on the last response only
    del values["return_perf_metrics"]
    values["return_final_perf_metrics"] = np.array([[True]])
    tensors = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    responses = list(served.client().stream_results("dhisparse", tensors))
    assert len(responses) > 1 and not any("kv_cache_missed_block" in r for r in responses[:-1])
    assert responses[-1]["kv_cache_missed_block"][0][0] == pages and responses[-1]["total_draft_tokens"][0][0] == 0

    text = {"text_input": np.array([[PROMPTS[0]]], dtype=object), "max_tokens": np.array([[4]], dtype=np.int32),
            "return_finish_reason": np.array([[True]]), "return_perf_metrics": np.array([[True]])}
    tensors = []
    for name, value in text.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    (response,) = served.client().stream_results("ensemble", tensors)
    assert response["finish_reason"][0][0] == b"length" and response["kv_cache_missed_block"][0][0] == pages


def test_a_prompt_sent_twice_reuses_its_pages_and_says_so(served):
    """The same long prompt twice to `dhisparse` with return_perf_metrics: the first finds nothing cached (every
    block new, hit rate 0); the second reuses full pages of the first's (kv_cache_reused_blocks > 0, and the same
    count as the `llmapi` model's kv_cache_reused_block), allocates only the rest (kv_cache_alloc_new_blocks = total -
    reused), misses the prompt's other pages, and reports kv_cache_hit_rate = reused / (reused + missed)."""
    page_rows = served.overrides["page_rows"]
    ids = np.random.default_rng(uuid.uuid4().int % (1 << 32)).integers(1, 300, 6 * page_rows + 5).tolist()  # unseen
    values = {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": np.array([[len(ids)]], dtype=np.int32),
              "request_output_len": np.array([[4]], dtype=np.int32), "return_perf_metrics": np.array([[True]])}
    tensors = []
    for name, value in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    names = ("kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks",
             "kv_cache_reused_block", "kv_cache_missed_block", "kv_cache_hit_rate")
    runs = []
    for _ in range(2):
        (response,) = served.client().stream_results("dhisparse", tensors)  # not streaming: one response
        runs.append({name: response[name][0][0].item() for name in names})
    first, second = runs
    prompt_pages = -(-len(ids) // page_rows)
    assert first["kv_cache_reused_blocks"] == first["kv_cache_reused_block"] == 0, first
    assert first["kv_cache_alloc_new_blocks"] == first["kv_cache_alloc_total_blocks"] >= prompt_pages, first
    assert first["kv_cache_missed_block"] == prompt_pages and first["kv_cache_hit_rate"] == 0.0, first
    reused = second["kv_cache_reused_blocks"]
    assert 0 < reused == second["kv_cache_reused_block"] < prompt_pages, second
    assert second["kv_cache_alloc_new_blocks"] == second["kv_cache_alloc_total_blocks"] - reused, second
    assert second["kv_cache_alloc_total_blocks"] == first["kv_cache_alloc_total_blocks"], runs
    assert second["kv_cache_missed_block"] == prompt_pages - reused, second
    assert second["kv_cache_hit_rate"] == pytest.approx(reused / prompt_pages) and second["kv_cache_hit_rate"] > 0
