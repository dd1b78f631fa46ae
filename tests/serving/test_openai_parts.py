"""The OpenAI front end's parts without a Triton server: stop strings and held-back text, chat templates, the
classification of Triton's error texts, and a deployment that cannot be reached (503), through the real app."""

from __future__ import annotations

import json

import openai
import pytest
from starlette.testclient import TestClient

from dhisparse.serving.openai.app import create_app
from dhisparse.serving.openai.chat_template import ChatTemplate
from dhisparse.serving.openai.choices import ChoiceText
from dhisparse.serving.openai.engine_client import EngineClient, SequenceChunk
from dhisparse.serving.openai.errors import OpenAIError, from_triton
from dhisparse.serving.openai.serving import EngineLimits, OpenAIServing
from dhisparse.serving.server import free_ports
from dhisparse.serving.tokenization import TokenBytes


@pytest.fixture(scope="module")
def token_bytes(tokenizer) -> TokenBytes:
    return TokenBytes(tokenizer)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _feed_one_by_one(choice: ChoiceText, ids: list[int]) -> list[str]:
    released = []
    for token in ids:
        if choice.stopped:
            break
        choice.feed(SequenceChunk([token]))
        released.append(choice.release().text)
    released.append(choice.release(final=True).text)
    return released


@pytest.mark.parametrize("stop", ["arrows", "s and a", "slings and arrows of"])
def test_stop_string_ends_the_text_before_it_and_nothing_is_taken_back(tokenizer, token_bytes, stop):
    text = "the slings and arrows of outrageous fortune"
    choice = ChoiceText(token_bytes, ("never", stop))
    released = _feed_one_by_one(choice, _ids(tokenizer, text))
    assert "".join(released) == text[: text.index(stop)]
    assert choice.stopped
    # the token that completed the stop string is the last one counted
    whole = _ids(tokenizer, text)
    counted = whole[: choice.completion_tokens]
    assert stop in token_bytes.decode(counted).decode() and stop not in token_bytes.decode(counted[:-1]).decode()


def test_without_a_match_all_text_arrives_and_multibyte_characters_are_whole(tokenizer, token_bytes):
    text = "naïve café 日本語 🙂 emoji"
    ids = _ids(tokenizer, text)
    choice = ChoiceText(token_bytes, ("zzzz",))
    released = _feed_one_by_one(choice, ids)
    assert "".join(released) == text and not choice.stopped and choice.completion_tokens == len(ids)
    assert "\ufffd" not in "".join(released)
    held = [len(r) for r in released[:-1]]
    assert max(held) <= 4  # released as it comes, holding back at most len("zzzz") - 1 characters


def test_token_entries_follow_their_text(tokenizer, token_bytes):
    text = "To be, or not to be"
    ids = _ids(tokenizer, text)
    choice = ChoiceText(token_bytes, ("not",))
    choice.feed(SequenceChunk(ids, log_probs=[-float(i) for i in range(len(ids))]))
    delta = choice.release(final=True)
    assert delta.text == "To be, or "
    assert b"".join(e.raw for e in delta.tokens).decode().startswith(delta.text)
    assert [e.log_prob for e in delta.tokens] == [-float(i) for i in range(len(delta.tokens))]
    assert all(e.start < len(delta.text) for e in delta.tokens)  # tokens inside the stop string are dropped


def test_chat_template_sources_and_errors(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "T"},
                          {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]"
                                                          "{{ m.content }}{% endfor %}{% if add_generation_prompt %}"
                                                          "[assistant]{% endif %}"}]}))
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ChatTemplate.load(tmp_path).render(messages) == "<s>[user]ab[assistant]"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}|{{ eos_token }}")
    assert ChatTemplate.load(tmp_path).render(messages) == "ab|</s>"  # the file wins over tokenizer_config.json
    override = tmp_path / "other.jinja"
    override.write_text("{{ raise_exception('no ' + messages[0].role) }}")
    with pytest.raises(OpenAIError, match="refused the messages: no user") as refused:
        ChatTemplate.load(tmp_path, override).render(messages)
    assert refused.value.status == 400 and refused.value.param == "messages"
    with pytest.raises(OpenAIError) as image:
        ChatTemplate.load(tmp_path).render([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert image.value.param == "messages[0].content" and "image_url" in image.value.message
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(OpenAIError, match="no chat template") as missing:
        ChatTemplate.load(tmp_path).render(messages)
    assert missing.value.status == 400
    override.write_text("{% if %}")
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.load(tmp_path, override)


@pytest.mark.parametrize(("message", "status"), [
    ("request failed: the engine stopped after a fault it could not recover from: InvariantError: x", 503),
    ("the engine is stopped: boom", 503),
    ("the engine loop was shut down before the request finished", 503),
    ("Request for unknown model: 'dhisparse' is not found", 503),
    ("Request for unknown model: 'dhisparse' has no available versions", 503),
    ("request failed: engine step failed: RuntimeError: injected fault at decode_forward", 500),
    ("the engine loop stopped before the request finished", 500),
    ("max_tokens 600 exceeds the engine limit: prompt (7) + max_tokens must be <= 512", 400),
    ("context phase: input_ids is missing: send the prompt's token ids", 400),
    ("token ids [400] are outside the vocabulary [0, 320)", 400),
])
def test_triton_error_texts_get_their_status(message, status):
    assert from_triton(message).status == status


def test_unreachable_deployment_is_503_through_the_app(tiny_engine):
    (port,) = free_ports(1)  # nothing listens there
    serving = OpenAIServing(EngineClient(f"127.0.0.1:{port}"), tiny_engine, "tiny", EngineLimits.load(tiny_engine),
                            ChatTemplate.load(tiny_engine))
    with TestClient(create_app(serving)) as http:
        api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=http)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as caught:
                api.completions.create(model="tiny", prompt="To be", max_tokens=4, stream=stream)
            assert caught.value.status_code == 503, caught.value.body
        assert http.get("/health").status_code == 503
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.NotFoundError):
            api.completions.create(model="other", prompt="To be")
        assert [m.id for m in api.models.list().data] == ["tiny"]


def test_builder_writes_the_chat_template(tiny_engine, tmp_path):
    from dhisparse_builder.build import BuildOptions, build_engine
    from dhisparse_builder.cli import main

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    engine = build_engine(BuildOptions(tiny_engine.parent / "checkpoint", tmp_path / "engine", {"dtype": "float32"},
                                       chat_template=template), progress=lambda done, total: None)
    rendered = ChatTemplate.load(engine).render([{"role": "user", "content": "hi"}])
    assert rendered == "user: hi\nassistant:"
    assert main(["--checkpoint", str(tiny_engine.parent / "checkpoint"), "--output", str(tmp_path / "other"),
                 "--chat-template", str(tmp_path / "missing.jinja")]) == 2  # a clear error, nothing written
    assert not (tmp_path / "other").exists()
