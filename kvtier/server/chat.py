"""A chat template: a checkpoint's (the Jinja template ``tokenizer_config.json`` or
``chat_template.jinja`` ships), one given with ``--chat-template``, or the built-in one of the
byte tokenizer the presets use; rendered in a sandbox the way Hugging Face tokenizers render it
(``messages``, ``add_generation_prompt``, ``bos_token``/``eos_token``, ``raise_exception``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.server.api_errors import invalid

ROLES = ("system", "developer", "user", "assistant", "tool")


def _token_text(value: Any) -> str:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """Renders ``messages`` to the prompt text the model was trained on."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.origin = "given"
        """Where the template came from, as the start-up summary says it."""

    @classmethod
    def load(cls, directory: str | Path) -> ChatTemplate | None:
        """The template of a checkpoint directory, or ``None`` when it has none. A template
        that does not parse raises ``ConfigError`` naming the file."""
        d = Path(directory)
        cfg_file = d / "tokenizer_config.json"
        cfg: dict[str, Any] = {}
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except (OSError, ValueError) as e:
                raise ConfigError(f"{cfg_file}: not readable JSON ({e})") from None
        source, where = cfg.get("chat_template"), cfg_file
        if isinstance(source, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja = d / "chat_template.jinja"
        if not isinstance(source, str) and jinja.is_file():
            source, where = jinja.read_text(), jinja
        if not isinstance(source, str):
            return None
        from jinja2 import TemplateError

        try:
            template = cls(
                source, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
            )
            template.origin = "the checkpoint's"
            return template
        except TemplateError as e:
            raise ConfigError(f"{where}: chat template does not parse: {e}") from None

    @classmethod
    def builtin(cls) -> ChatTemplate:
        """The byte tokenizer's template (``kvtier.engine.byte_tokenizer.CHAT_TEMPLATE``)."""
        from kvtier.engine.byte_tokenizer import BOS, CHAT_TEMPLATE, EOS

        template = cls(CHAT_TEMPLATE, BOS, EOS)
        template.origin = "the built-in one"
        return template

    @classmethod
    def from_option(cls, value: str, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """``--chat-template``: the path of a Jinja file, or the template itself (text holding
        ``{{`` or ``{%``). Raises ``ConfigError`` naming the option."""
        path = Path(value)
        if path.is_file():
            try:
                source = path.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"--chat-template {value}: not readable ({e})") from None
        elif "{{" in value or "{%" in value:
            source = value
        else:
            raise ConfigError(
                f"--chat-template {value!r}: no such file, and not a Jinja template either"
            )
        from jinja2 import TemplateError

        try:
            template = cls(source, bos_token, eos_token)
        except TemplateError as e:
            raise ConfigError(f"--chat-template: the template does not parse: {e}") from None
        template.origin = "from --chat-template"
        return template

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (validated by ``check_messages``), followed by the
        assistant turn's opening unless ``add_generation_prompt`` is false. A template that
        refuses them is a 400 naming ``messages``."""
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise invalid(f"the chat template refused the messages: {e}", "messages") from None


def check_messages(value: Any) -> list[dict[str, str]]:
    """``messages`` as ``[{"role", "content"}]`` with text content (a string, or a list of
    ``{"type": "text", "text"}`` parts, joined). Raises a 400 ``APIError`` naming the field."""
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty array of messages", "messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{where} must be an object with role and content", where)
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", where)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise invalid(
                        f"{where}.content[{j}]: only text parts are supported",
                        f"{where}.content",
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if not isinstance(content, str):
            raise invalid(f"{where}.content must be a string or text parts", f"{where}.content")
        out.append({"role": role, "content": content})
    return out
