"""The engine tokenizer's chat template: OpenAI chat messages -> one prompt string.

Where the template comes from, first found wins: an explicit file (`dhisparse-serve --chat-template FILE`), the
engine directory's ``chat_template.jinja`` (Hugging Face's file; `dhisparse-build` copies it from the checkpoint or
writes it from ``--chat-template``), or the ``chat_template`` entry of its ``tokenizer_config.json`` (a string, or
a list of named templates: the one named ``default``). Without one, chat requests fail with a 400 that says how to
give the model a template; completions work regardless.

Rendering follows transformers' `apply_chat_template`: a sandboxed Jinja2 environment (``trim_blocks``,
``lstrip_blocks``), variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` (from
``tokenizer_config.json``), the ``raise_exception`` and ``strftime_now`` functions and the ``tojson`` filter. Message
content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined); other parts are refused. The
rendered prompt is tokenized without adding special tokens (the template writes them, e.g. BOS).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from dhisparse.serving.openai.errors import OpenAIError, bad_request

TEMPLATE_FILE = "chat_template.jinja"


def _special(config: dict[str, Any], name: str) -> str:
    value = config.get(name) or ""
    return value.get("content", "") if isinstance(value, dict) else str(value)


def _raise_exception(message: str) -> None:
    raise bad_request(f"the chat template refused the messages: {message}", "messages")


class ChatTemplate:
    """A compiled chat template (or none) with the special tokens it may refer to.

    Args:
        source: the Jinja2 template text, or None when the model has no template.
        bos_token / eos_token: the tokenizer's special token strings.
        origin: where the template came from (for messages).
    """

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "", origin: str = "") -> None:
        self.source, self.bos_token, self.eos_token, self.origin = source, bos_token, eos_token, origin
        self._template = None
        if source is not None:
            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            environment.globals["raise_exception"] = _raise_exception
            environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False,
                                                                                  indent=indent)
            self._template = environment.from_string(source)

    @classmethod
    def load(cls, engine_dir: Path, override: Path | None = None) -> ChatTemplate:
        """The template of an engine directory (see the module docstring); `override` is a template file.
        Raises ValueError when `override` cannot be read or a template does not compile."""
        engine_dir = Path(engine_dir)
        config_path = engine_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        bos, eos = _special(config, "bos_token"), _special(config, "eos_token")
        if override is not None:
            if not Path(override).is_file():
                raise ValueError(f"chat template file {override} not found")
            return cls._compiled(Path(override).read_text(), bos, eos, str(override))
        if (engine_dir / TEMPLATE_FILE).is_file():
            return cls._compiled((engine_dir / TEMPLATE_FILE).read_text(), bos, eos, str(engine_dir / TEMPLATE_FILE))
        entry = config.get("chat_template")
        if isinstance(entry, list):
            entry = next((t.get("template") for t in entry if t.get("name") == "default"), None)
        return cls._compiled(entry, bos, eos, f"{config_path} chat_template") if entry else cls(None, bos, eos)

    @classmethod
    def _compiled(cls, source: str, bos: str, eos: str, origin: str) -> ChatTemplate:
        try:
            return cls(source, bos, eos, origin)
        except Exception as error:  # jinja2.TemplateSyntaxError and friends
            raise ValueError(f"chat template {origin} does not compile: {error}") from error

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` (dicts with ``role`` and ``content``). Raises OpenAIError (400) when the model
        has no template, a message is malformed, or the template refuses the conversation."""
        if self._template is None:
            raise bad_request("this model's tokenizer has no chat template, so chat completions cannot be served: "
                              "use /v1/completions, or give the model a template (dhisparse-serve --chat-template "
                              "FILE, or dhisparse-build --chat-template FILE)", "messages")
        plain = [self._plain(i, message) for i, message in enumerate(messages)]
        try:
            return self._template.render(messages=plain, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except OpenAIError:
            raise
        except Exception as error:  # the template failed on these messages (jinja2 errors, missing keys, ...)
            raise bad_request(f"the chat template failed on these messages: {error}", "messages") from error

    @staticmethod
    def _plain(index: int, message: dict[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad_request(f"message {index}: content part of type {kind!r} is not supported (text only)",
                                      f"messages[{index}].content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        return {**message, "content": content}
