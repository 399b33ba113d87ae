"""The tokenizer of a model directory: `tokenizers.Tokenizer` plus the chat template, as transformers reads them.

Files read from the directory:

    tokenizer.json          the tokenizer itself (required)
    tokenizer_config.json   bos/eos/unk/pad token strings, and the chat template in older directories
    chat_template.jinja     the chat template as transformers 5 writes it (wins over tokenizer_config)

Chat templates render with jinja2 the way transformers renders them (an immutable sandbox,
`trim_blocks`/`lstrip_blocks`, `raise_exception`, `strftime_now`, a `tojson` that does not escape
HTML, and the special-token strings as variables), so a prompt is byte-identical to the reference.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvtool.engine.errors import InputError, ModelError

# Used when a directory has no template, so chat requests still work on any model.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body; transformers uses it only for assistant masks."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same environment transformers uses. Raises jinja2.TemplateSyntaxError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_string(value: Any) -> str | None:
    # tokenizer_config.json stores a token either as a string or as a serialised AddedToken dict.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """Text <-> token ids for one model directory, and its chat template.

    Built by `Tokenizer.from_dir` (or directly from a `tokenizers.Tokenizer` for tests). Immutable
    after construction; safe to share between threads for encode/decode.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        # bos_token, eos_token, ... -> their strings; templates see them as variables.
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.has_chat_template = chat_template is not None
        self.chat_template_source = chat_template if chat_template is not None else CHATML_TEMPLATE
        self._template = compile_chat_template(self.chat_template_source)

    def with_chat_template(self, source: str) -> Tokenizer:
        """The same tokenizer with another chat template (`serve --chat-template`); InputError when it does not compile."""
        try:
            return Tokenizer(self.backend, special_tokens=self.special_tokens, chat_template=source)
        except jinja2.TemplateSyntaxError as e:
            raise InputError(f"the chat template does not compile (line {e.lineno}: {e.message})") from None

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja from a model directory.

        Raises ModelError (one line, naming the file) when tokenizer.json is missing or unreadable,
        tokenizer_config.json is not valid JSON, or the chat template does not compile.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelError(f"{tok_file}: missing (a model directory needs a tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelError(f"{tok_file}: cannot be read as a tokenizer ({_first_line(e)})") from None

        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise ModelError(f"{cfg_file}: invalid JSON ({_first_line(e)})") from None
            if not isinstance(cfg, dict):
                raise ModelError(f"{cfg_file}: expected a JSON object")

        special = {k: s for k in _SPECIAL_TOKEN_KEYS if (s := _token_string(cfg.get(k))) is not None}

        template_file = path / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        if template is None:
            template = _template_from_config(cfg.get("chat_template"))
        try:
            return cls(backend, special_tokens=special, chat_template=template)
        except jinja2.TemplateSyntaxError as e:
            where = template_file if template_file.is_file() else cfg_file
            raise ModelError(f"{where}: chat template does not compile (line {e.lineno}: {e.message})") from None

    # -- ids ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        tok = self.special_tokens.get("bos_token")
        return None if tok is None else self.backend.token_to_id(tok)

    @property
    def eos_token_id(self) -> int | None:
        tok = self.special_tokens.get("eos_token")
        return None if tok is None else self.backend.token_to_id(tok)

    # -- text --------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens applies tokenizer.json's post-processor (e.g. a BOS).

        Text rendered by a chat template already holds its special tokens: encode it with
        add_special_tokens=False, as transformers does.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids the vocabulary does not know decode to nothing."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) into the prompt text.

        Extra keyword arguments (tools, enable_thinking, ...) reach the template as variables, like
        transformers' `apply_chat_template(..., **kwargs)`. Raises InputError when the template
        refuses the conversation (its `raise_exception`, e.g. roles that do not alternate).
        """
        variables = {**self.special_tokens, "tools": None, "documents": None, **template_kwargs}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:
            raise InputError(f"chat template refused the messages: {_first_line(e)}") from None


def _template_from_config(value: Any) -> str | None:
    # Older directories keep the template in tokenizer_config.json: a string, or a list of named templates.
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
