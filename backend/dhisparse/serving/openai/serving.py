"""Completions and chat completions: OpenAI requests -> sequences on the Triton deployment -> OpenAI responses.

A request becomes one sequence per prompt and choice (``n``), each streamed on its own gRPC stream
(`EngineClient`) by its own task, which feeds a `ChoiceText` (detokenisation, stop strings, log-probs) and
posts what it releases to one queue. Choice ``i`` of a request with ``seed`` s samples with seed ``s + i`` (as
the ensemble's ``num_return_sequences`` does). Non-streaming, the queue is drained into one response; streaming,
each event becomes a server-sent event as it comes, then the usage chunk (``stream_options.include_usage``) and
``data: [DONE]``. Before any of that, the server's per-request limits are checked (`edge_limits`: prompts, ``n``,
stop strings, ``logit_bias``, prompt bytes before tokenising, prompt tokens), and prompts are tokenised (and chat
templates rendered) on a worker thread, so one large prompt does not hold up the event loop serving every other
client. A streamed request's first event is awaited before the response starts, so an immediate
refusal keeps its HTTP status; a later failure is sent as an ``{"error": ...}`` event. `EventStream.close`
(the client went away, or the response is complete) cancels every sequence still running.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from tokenizers import Tokenizer

from dhisparse.serving.limits import RequestLimits
from dhisparse.serving.openai import responses
from dhisparse.serving.openai.chat_template import ChatTemplate
from dhisparse.serving.openai.choices import ChoiceText, Delta
from dhisparse.serving.openai.edge_limits import EdgeLimits
from dhisparse.serving.openai.engine_client import EngineClient, SequenceRequest
from dhisparse.serving.openai.errors import OpenAIError, bad_request, model_not_found
from dhisparse.serving.openai.protocol import ChatCompletionRequest, CommonParams, CompletionRequest
from dhisparse.serving.tokenization import TokenBytes, load_tokenizer

SEED_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class EngineLimits:
    """What the front end must know of the engine: context length, per-request token limit, KV page size."""

    max_model_len: int
    max_new_tokens_limit: int = 0  # 0 = up to max_model_len
    page_rows: int = 64

    @classmethod
    def load(cls, engine_dir: Path, overrides: dict[str, object] | None = None) -> EngineLimits:
        """From the engine's ``runtime.json`` with `dhisparse-serve`'s overrides on top (0 context length: the
        model's ``max_position_embeddings``)."""
        runtime = {**json.loads((Path(engine_dir) / "runtime.json").read_text()), **(overrides or {})}
        length = int(runtime.get("max_model_len") or 0)
        if not length:
            length = int(json.loads((Path(engine_dir) / "config.json").read_text())["max_position_embeddings"])
        return cls(length, int(runtime.get("max_new_tokens_limit") or 0), int(runtime.get("page_rows") or 64))


@dataclass
class _Sequence:
    """One choice being generated."""

    index: int
    prompt: int
    request: SequenceRequest
    text: ChoiceText
    finish_reason: str | None = None
    stats: dict[str, int] = field(default_factory=dict)


class EventStream:
    """The sequences of one request, each run by a task posting ``(kind, sequence, payload)`` to a queue: ``delta``
    (a `Delta`), ``done`` (the last `Delta`; `finish_reason` set) or ``error`` (an `OpenAIError`)."""

    def __init__(self, sequences: list[_Sequence], run: Callable) -> None:
        self.sequences = sequences
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.create_task(run(s, self.queue)) for s in sequences]
        self.open = len(sequences)

    async def next(self) -> tuple[str, _Sequence | None, Any]:
        event: tuple[str, _Sequence | None, Any] = await self.queue.get()
        if event[0] == "done":
            self.open -= 1
        return event

    async def close(self) -> None:
        """Cancel every sequence still running (its gRPC stream is cancelled, so its engine request is aborted)
        and wake a reader waiting for events."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.queue.put_nowait(("closed", None, None))


class OpenAIServing:
    """Serves the OpenAI API for one engine through its Triton deployment.

    Args:
        engine: the Triton client of the deployment's LLM model.
        engine_dir: the engine directory (tokenizer, chat template, runtime).
        model_name: the model id clients send (``/v1/models`` lists it).
        limits: context length and token limits (`EngineLimits.load`).
        chat_template: the chat template (`ChatTemplate.load`).
        add_special_tokens: whether completions prompts get the tokenizer's special tokens (the ensemble's
            ``preprocessing`` setting, so text prompts tokenize alike).
        request_limits: the server's per-request limits (`RepositorySpec.resolved_limits`, what the Triton models
            check); values left at 0 are derived here from `limits` and the tokenizer. Default: the defaults.
    """

    def __init__(self, engine: EngineClient, engine_dir: Path, model_name: str, limits: EngineLimits,
                 chat_template: ChatTemplate, add_special_tokens: bool = True,
                 request_limits: RequestLimits | None = None) -> None:
        self.engine, self.model_name, self.limits = engine, model_name, limits
        self.chat_template, self.add_special_tokens = chat_template, add_special_tokens
        self.tokenizer: Tokenizer = load_tokenizer(engine_dir)
        self.token_bytes = TokenBytes(self.tokenizer)
        request_limits = request_limits or RequestLimits()
        self.edge = EdgeLimits(request_limits.resolved(limits.max_model_len, self.token_bytes.vocab_size,
                                                       request_limits.max_batch))

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise model_not_found(model, self.model_name)

    # ------------------------------------------------------------------------------------------ requests
    def _check_request(self, body: CommonParams, prompts: int) -> None:
        """The limits that bound a request's work as a whole, checked before any prompt is looked at."""
        self.edge.check_choices(prompts, body.n)
        self.edge.check_stops(body.stop_strings())
        self.edge.check_logit_bias(body.logit_bias)

    async def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of `texts`, tokenised on a worker thread (`encode_batch`: unlike `encode`, it releases the GIL
        while it works, so the event loop goes on serving other clients)."""
        def encode() -> list[list[int]]:
            return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

        return await anyio.to_thread.run_sync(encode) if texts else []

    def _sequences(self, body: CommonParams, prompts: list[list[int]], max_tokens: int | None,
                   logprobs: int | None, prompt_param: str = "prompt") -> list[_Sequence]:
        if logprobs is not None:
            self.engine.require("log-probabilities", "logprobs", "return_log_probs")
            if logprobs:
                self.engine.require("top log-probabilities", "logprobs", "num_top_log_probs")
        bias = body.token_bias(self.token_bytes.vocab_size)
        for feature, param, name, used in (
                ("logit_bias", "logit_bias", "embedding_bias", bool(bias)),
                ("seeded sampling", "seed", "random_seed", body.seed is not None),
                ("presence_penalty", "presence_penalty", "presence_penalty", body.presence_penalty != 0),
                ("frequency_penalty", "frequency_penalty", "frequency_penalty", body.frequency_penalty != 0),
                ("repetition_penalty", "repetition_penalty", "repetition_penalty", body.repetition_penalty != 1),
                ("top_k", "top_k", "runtime_top_k", body.top_k > 0),
                ("min_tokens", "min_tokens", "min_length", body.min_tokens > 0)):
            if used:
                self.engine.require(feature, param, name)
        stops = body.stop_strings()
        out = []
        for p, ids in enumerate(prompts):
            if not ids:
                raise bad_request("the prompt is empty", prompt_param)
            room = self.limits.max_model_len - len(ids)
            if room < 1:
                raise bad_request(f"the prompt has {len(ids)} tokens; this model's context length is "
                                  f"{self.limits.max_model_len}", prompt_param)
            limit = max_tokens if max_tokens is not None else min(
                room, self.limits.max_new_tokens_limit or room)
            for i in range(body.n):
                seed = None if body.seed is None else (body.seed + i) & SEED_MASK
                request = SequenceRequest(
                    list(ids), limit, body.temperature, body.top_p, max(body.top_k, 0), seed, body.presence_penalty,
                    body.frequency_penalty, body.repetition_penalty, body.min_tokens, bias, logprobs, bool(stops))
                out.append(_Sequence(p * body.n + i, p, request, ChoiceText(self.token_bytes, stops)))
        return out

    async def _run(self, sequence: _Sequence, queue: asyncio.Queue) -> None:
        try:
            stream = self.engine.generate(sequence.request, f"openai-{uuid.uuid4().hex[:12]}-{sequence.index}")
            try:
                async for chunk in stream:
                    sequence.text.feed(chunk)
                    sequence.stats.update(chunk.stats)
                    sequence.finish_reason = chunk.finish_reason or sequence.finish_reason
                    if sequence.text.stopped:
                        break  # closing the stream cancels the rest of the sequence on the server
                    delta = sequence.text.release()
                    if delta.text or (delta.tokens and sequence.request.logprobs is not None):
                        queue.put_nowait(("delta", sequence, delta))
            finally:
                await stream.aclose()
            sequence.finish_reason = self._finish_reason(sequence)
            queue.put_nowait(("done", sequence, sequence.text.release(final=True)))
        except OpenAIError as error:
            queue.put_nowait(("error", sequence, error))
        except Exception as error:  # a bug here must still end the response (cancellation is a BaseException)
            queue.put_nowait(("error", sequence, OpenAIError(500, f"internal error: {type(error).__name__}: "
                                                                  f"{error}")))

    @staticmethod
    def _finish_reason(sequence: _Sequence) -> str:
        if sequence.text.stopped:
            return "stop"
        if sequence.finish_reason in ("stop", "length"):
            return sequence.finish_reason
        # not reported (the disaggregated orchestrator) or "abort": the token count tells a length stop
        return "length" if sequence.text.completion_tokens >= sequence.request.max_tokens else "stop"

    def _usage(self, sequences: list[_Sequence], prompts: list[list[int]]) -> responses.Usage:
        usage = responses.Usage(sum(len(p) for p in prompts), sum(s.text.completion_tokens for s in sequences))
        if all("kv_cache_reused_block" in s.stats for s in sequences):
            first = {s.prompt: s for s in reversed(sequences)}  # one per prompt: its first choice
            usage.cached_tokens = sum(s.stats["kv_cache_reused_block"] * self.limits.page_rows
                                      for s in first.values())
        if all("total_draft_tokens" in s.stats for s in sequences):
            usage.accepted_draft_tokens = sum(s.stats["total_accepted_draft_tokens"] for s in sequences)
            usage.draft_tokens = sum(s.stats["total_draft_tokens"] for s in sequences)
        return usage

    async def _start(self, sequences: list[_Sequence]) -> tuple[EventStream, tuple]:
        """Start every sequence and wait for the first event; an immediate error is raised (its HTTP status)."""
        events = EventStream(sequences, self._run)
        try:
            first = await events.next()
        except BaseException:
            await events.close()
            raise
        if first[0] == "error":
            await events.close()
            raise first[2]
        return events, first

    async def _collect(self, events: EventStream, first: tuple) -> dict[int, list[Delta]]:
        """Every delta of every sequence (non-streaming); raises the first error."""
        deltas: dict[int, list[Delta]] = {s.index: [] for s in events.sequences}
        event = first
        try:
            while True:
                kind, sequence, payload = event
                if kind == "error":
                    raise payload
                deltas[sequence.index].append(payload)
                if events.open == 0:
                    return deltas
                event = await events.next()
        finally:
            await events.close()

    # --------------------------------------------------------------------------------------- completions
    async def _prompt_ids(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Each prompt's token ids; every size limit is checked on every prompt before any is tokenised."""
        for prompt in prompts:
            if isinstance(prompt, str):
                if not prompt:
                    raise bad_request("the prompt is empty", "prompt")
                self.edge.check_text(prompt, "prompt")
            else:
                self.edge.check_tokens(len(prompt), "prompt")
        encoded = iter(await self._encode([p for p in prompts if isinstance(p, str)], self.add_special_tokens))
        out = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
        for ids in out:
            self.edge.check_tokens(len(ids), "prompt")
        return out

    async def completions(self, body: CompletionRequest) -> dict[str, Any] | AsyncGenerator[str, None]:
        """A ``text_completion`` object, or (``stream``) an iterator of server-sent events."""
        self.check_model(body.model)
        texts = body.prompts()
        self._check_request(body, len(texts))
        prompts = await self._prompt_ids(texts)
        sequences = self._sequences(body, prompts, body.max_tokens, body.logprobs)
        echo = [(t if isinstance(t, str) else self.token_bytes.decode(t).decode("utf-8", "replace")) if body.echo
                else "" for t in texts]
        response_id, created = responses.new_id("cmpl"), responses.now()
        events, first = await self._start(sequences)
        top = bool(body.logprobs)

        def choice(sequence: _Sequence, delta: Delta, offset: int, finish: str | None) -> dict[str, Any]:
            logprobs = None if body.logprobs is None else responses.completion_logprobs(
                delta.tokens, self.token_bytes, offset, top)
            return responses.completion_choice(sequence.index, delta.text, logprobs, finish)

        if not body.stream:
            deltas = await self._collect(events, first)
            choices = []
            for s in events.sequences:
                whole = Delta("".join(d.text for d in deltas[s.index]), [e for d in deltas[s.index] for e in d.tokens])
                whole.text = echo[s.prompt] + whole.text
                choices.append(choice(s, whole, len(echo[s.prompt]), s.finish_reason))
            return responses.completion(response_id, created, self.model_name, choices,
                                        self._usage(events.sequences, prompts))

        def chunk(sequence: _Sequence, delta: Delta, finish: str | None, started: set[int]) -> dict[str, Any]:
            prefix = echo[sequence.prompt] if sequence.index not in started else ""
            started.add(sequence.index)
            delta.text = prefix + delta.text
            return responses.completion(response_id, created, self.model_name,
                                        [choice(sequence, delta, len(echo[sequence.prompt]), finish)], None)

        return self._sse(events, first, chunk, lambda usage: responses.completion(
            response_id, created, self.model_name, [], usage), prompts, body.include_usage(), set())

    # ---------------------------------------------------------------------------------------------- chat
    async def chat(self, body: ChatCompletionRequest) -> dict[str, Any] | AsyncGenerator[str, None]:
        """A ``chat.completion`` object, or (``stream``) an iterator of ``chat.completion.chunk`` events."""
        self.check_model(body.model)
        self._check_request(body, 1)
        messages = body.message_dicts()
        self.edge.check_messages(messages)

        def render() -> str:  # on the worker thread too: a template is Python code running over every message
            prompt = self.chat_template.render(messages, body.add_generation_prompt)
            self.edge.check_text(prompt, "messages", "the rendered chat prompt")
            return prompt

        (ids,) = await self._encode([await anyio.to_thread.run_sync(render)], False)
        self.edge.check_tokens(len(ids), "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sequences = self._sequences(body, [ids], body.answer_limit(), logprobs, "messages")
        response_id, created = responses.new_id("chatcmpl"), responses.now()
        events, first = await self._start(sequences)

        def logprobs_of(delta: Delta) -> dict[str, Any] | None:
            return responses.chat_logprobs(delta.tokens, self.token_bytes) if body.logprobs else None

        if not body.stream:
            deltas = await self._collect(events, first)
            choices = []
            for s in events.sequences:
                whole = Delta("".join(d.text for d in deltas[s.index]), [e for d in deltas[s.index] for e in d.tokens])
                choices.append(responses.chat_choice(s.index, whole.text, logprobs_of(whole), s.finish_reason))
            return responses.chat(response_id, created, self.model_name, choices, self._usage(events.sequences, [ids]))

        def chunk(sequence: _Sequence, delta: Delta, finish: str | None, started: set[int]) -> dict[str, Any]:
            content: dict[str, Any] = {"content": delta.text} if delta.text or not finish else {}
            if sequence.index not in started:
                started.add(sequence.index)
                content = {"role": "assistant", **content}
            return responses.chat(response_id, created, self.model_name,
                                  [responses.chat_delta(sequence.index, content, logprobs_of(delta), finish)],
                                  None, True)

        return self._sse(events, first, chunk, lambda usage: responses.chat(
            response_id, created, self.model_name, [], usage, True), [ids], body.include_usage(), set())

    # ----------------------------------------------------------------------------------------- streaming
    async def _sse(self, events: EventStream, first: tuple, chunk: Callable, usage_chunk: Callable,
                   prompts: list[list[int]], include_usage: bool, started: set[int]) -> AsyncGenerator[str, None]:
        """Server-sent events for `events` (see the module docstring); closing the iterator (the client went
        away) cancels the sequences still running."""
        event = first
        try:
            while True:
                kind, sequence, payload = event
                if kind == "closed":
                    return
                if kind == "error":
                    yield f"data: {json.dumps(payload.body())}\n\n"
                    break
                finish = sequence.finish_reason if kind == "done" else None
                if payload.text or payload.tokens or finish:
                    yield f"data: {json.dumps(chunk(sequence, payload, finish, started))}\n\n"
                if events.open == 0:
                    if include_usage:
                        yield f"data: {json.dumps(usage_chunk(self._usage(events.sequences, prompts)))}\n\n"
                    break
                event = await events.next()
            yield "data: [DONE]\n\n"
        finally:
            await events.close()
