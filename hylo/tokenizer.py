"""Tokenizers: a checkpoint's ``tokenizer.json`` (through the ``tokenizers`` library), or the byte-level tokenizer
of the embedded default model. Both offer the same small interface, chat templates included."""

from __future__ import annotations

import json
import os
import sys

BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# A minimal ChatML template: what the embedded default model and template-less checkpoints use for chat. With
# tools, Qwen's (Hermes-style) form: the functions' signatures in the system turn, calls as JSON in <tool_call>
# tags, tool answers in <tool_response> tags of a user turn.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}{% if m['content'] or not loop.first %}\n{% endif %}<tool_call>\n"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ChatTemplateError(RuntimeError):
    """The model's chat template cannot be used (it does not compile): the model's fault, not a request's."""


class _TemplateMixin:
    chat_template: str | None = None
    # the tokens a template writes as {{ bos_token }} / {{ eos_token }} (tokenizer_config.json's; "" where none)
    bos_token = eos_token = ""
    _compiled = None

    def compiled_template(self):
        """The chat template (ChatML if the tokenizer has none) compiled once, in the sandboxed environment chat
        templates are written for; a ChatTemplateError where it does not compile."""
        if self._compiled is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # block trimming, loop controls, a plain tojson
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"], undefined=jinja2.Undefined)
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
                json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
            try:
                self._compiled = env.from_string(self.chat_template or CHATML_TEMPLATE)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"the model's chat template does not compile (line {e.lineno}: {e.message})"
                                        ) from None
        return self._compiled

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            extra: dict | None = None) -> str:
        """Render chat messages to a prompt string with the tokenizer's template (ChatML if it has none);
        ``extra``: more template variables (a request's ``chat_template_kwargs``, e.g. ``enable_thinking``)."""
        values = dict(extra or {})
        values.update(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                      eos_token=self.eos_token)
        return self.compiled_template().render(**values)


def _raise(message):
    raise ValueError(message)


def check_text(text: str) -> None:
    """A ValueError for text that is not a string of characters: a lone UTF-16 surrogate (JSON's ``"\\ud800"``
    decodes to one) has no UTF-8 bytes, so no tokenizer can encode it."""
    if not isinstance(text, str):
        raise ValueError(f"expected text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}), "
                         "which is not a character (JSON's \\ud800-style escapes and bytes that are not UTF-8 "
                         "decode to these)") from None


class HFTokenizer(_TemplateMixin):
    """A ``tokenizer.json`` from a checkpoint directory."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # the tokenizers library raises its own bare Exception on a corrupt file
            raise ValueError(f"{file} cannot be read as a tokenizer ({str(e).strip() or type(e).__name__})") from None
        config = _read_tokenizer_config(path)
        self.chat_template = _read_chat_template(path, config)
        self.bos_token, self.eos_token = (_token_text(config, name) for name in ("bos_token", "eos_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        self.special_ids = {i for i, t in added.items() if t.special}
        self._added_ids = set(added)  # written as themselves (UTF-8), not in the model's byte alphabet
        # SentencePiece-style vocabularies (Metaspace: "▁" for a space; byte fallback: "<0x0A>" for a byte)
        decoder = json.dumps(json.loads(self._tok.to_str()).get("decoder"))
        self._metaspace = "Metaspace" in decoder or "ByteFallback" in decoder or "\\u2581" in decoder

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_text(text)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_piece(self, token_id: int) -> str:
        """The token as the vocabulary writes it (byte-level BPE's 'Ġword', say)."""
        return self._tok.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as it appears inside a text: a byte-level BPE token's (maybe part of a
        UTF-8 character), a SentencePiece token's with its leading space (``▁``) and a byte fallback token's
        one byte (``<0x0A>``), an added token's own text."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if self._metaspace:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            return piece.replace("▁", " ").encode("utf-8")
        if all(c in _UNICODE_TO_BYTE for c in piece):  # the byte-level alphabet: one character per byte
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")


class ByteTokenizer(_TemplateMixin):
    """Bytes 0..255 are tokens 0..255; the special tokens follow. Decoding skips special tokens."""

    def __init__(self):
        self.vocab_size = 256 + len(BYTE_SPECIALS)
        self.special_ids = set(range(256, self.vocab_size))
        self.chat_template = CHATML_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:  # (adds none either way)
        check_text(text)
        out: list[int] = []
        i = 0
        while i < len(text):  # special tokens written in the text become their ids (as in chat templates)
            for j, tok in enumerate(BYTE_SPECIALS):
                if text.startswith(tok, i):
                    out.append(256 + j)
                    i += len(tok)
                    break
            else:
                nxt = min((p for p in (text.find(t, i) for t in BYTE_SPECIALS) if p >= 0), default=len(text))
                out.extend(text[i:nxt].encode("utf-8"))
                i = nxt
        return out

    def decode(self, ids: list[int]) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def token_id(self, token: str) -> int | None:
        return 256 + BYTE_SPECIALS.index(token) if token in BYTE_SPECIALS else None

    def token_piece(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else BYTE_SPECIALS[token_id - 256].encode("utf-8")


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's map from the printable characters it writes bytes as back to the bytes (GPT-2's scheme:
    printable bytes stand for themselves, the others for the characters from U+0100 on, in order)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_UNICODE_TO_BYTE = _byte_alphabet()


def _read_tokenizer_config(path: str) -> dict:
    """``tokenizer_config.json`` ({} where there is none); a ValueError naming the file where it is not an object."""
    file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _token_text(config: dict, name: str) -> str:
    """A special token's text in ``tokenizer_config.json`` (a string, or an added token's ``{"content": ...}``)."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _read_chat_template(path: str, cfg: dict) -> str | None:
    """The checkpoint's chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``
    (``cfg``: a string, or named templates of which the default one); None where it has none. A ValueError naming
    the file that holds something else."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    file = os.path.join(path, "tokenizer_config.json")
    tmpl = cfg.get("chat_template")
    if tmpl is None or isinstance(tmpl, str):
        return tmpl
    if isinstance(tmpl, list) and all(isinstance(e, dict) and isinstance(e.get("template"), str) for e in tmpl):
        # named templates: take the default one
        return next((e["template"] for e in tmpl if e.get("name") == "default"), None)
    raise ValueError(f"{file}: chat_template must be a string or a list of {{'name', 'template'}} objects, got "
                     f"{json.dumps(tmpl)[:80]}")


def load_tokenizer(path: str) -> HFTokenizer | None:
    """The checkpoint's tokenizer, or None when the directory has no ``tokenizer.json``; a ValueError naming the
    file when it cannot be read as one."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    tok = HFTokenizer(path)
    try:
        tok.compiled_template()
    except ChatTemplateError as e:  # completions still serve; chat requests get this as the server's error
        print(f"[hylo] warning: {e}: chat requests will fail", file=sys.stderr)
    return tok
