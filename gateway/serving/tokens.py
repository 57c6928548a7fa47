"""The tokenizer side of the gateway: chat template, prompt encoding, token bytes and token strings.

`Tokens` wraps a Hugging Face tokenizer: `chat_prompt(messages)` renders the model's chat template (with the
generation prompt, and a tool-calling request's tools through `gateway.structured.tools`) into ids; `encode`/`decode`
for text completions, `decode_stream` for incremental decoding; `token_bytes` is each id's exact bytes (byte-level BPE
tokens mapped back through the GPT-2 byte alphabet; special tokens are None), used by logprobs (`bytes`, and the `token`
string, which is `bytes:\\x..` for a token that is not valid UTF-8 on its own, as OpenAI does); `grammar_tokenizer`
is llguidance's view of the tokenizer for structured output (built on first use).
"""
from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Set

from tokenizers.decoders import DecodeStream

from gateway.errors import bad_request
from gateway.schemas import ChatMessage, ToolDefinition
from gateway.structured.tools import render_messages, tool_dicts
from swarm.client.api import GrammarTokenizer


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE tokenizers."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"Content part type '{part.type}' is not supported: this model takes text only.",
                              param=f"messages.{index}.content")
        texts.append(part.text)
    return "\n".join(texts)


class Tokens:
    def __init__(self, tokenizer, eos_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = sorted({int(i) for i in eos_token_ids} | (
            {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()))
        self._token_bytes: Optional[List[Optional[bytes]]] = None
        self._grammar_tokenizer: Optional[GrammarTokenizer] = None
        self._lock = threading.Lock()
        self._reserved: Optional[FrozenSet[str]] = None  # `_template_arguments`, once read

    # ---- prompts ------------------------------------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                    template_kwargs: Optional[Dict[str, Any]] = None,
                    tools: Optional[Sequence[ToolDefinition]] = None) -> List[int]:
        """The prompt ids of `messages` through the model's chat template; `template_kwargs` (vLLM's
        `chat_template_kwargs`, e.g. `enable_thinking`) become extra variables of the template. A key that is one of
        `apply_chat_template`'s own arguments (`tokenize`, `tools`, ...) is a 400, not a way around the gateway's.
        `tools`: the tools to show the model (the template's own rendering when it has one, else Hermes')."""
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & self._template_arguments())
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set '{reserved[0]}' (an argument of the chat template "
                              f"call, not a template variable).", param="chat_template_kwargs")
        template = getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise bad_request("This model has no chat template; use /v1/completions.", param="messages")
        native = isinstance(template, str) and "tools" in template
        rendered = render_messages(messages, [message_text(m, i) for i, m in enumerate(messages)], tools, native)
        if tools and native:
            extra["tools"] = tool_dicts(tools)
        try:
            out = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, return_dict=True, **extra)
        except Exception as e:  # jinja errors raised by the template itself (e.g. role order it forbids)
            raise bad_request(f"The messages do not fit the model's chat template: {e}", param="messages") from None
        return list(out["input_ids"])

    def _template_arguments(self) -> Set[str]:
        """`apply_chat_template`'s own argument names (read once: `inspect.signature` per request was a fifth of
        `chat_prompt`'s time)."""
        if self._reserved is None:
            params = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
            self._reserved = frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)) | \
                {"conversation"}
        return set(self._reserved)

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_stream(self) -> Optional[Callable[[], Callable[[int], Optional[str]]]]:
        """A maker of incremental decoders, one per choice (token id -> the text it completes, or None while a
        character is incomplete), giving the same text as `decode`; None where the tokenizer has no fast backend or
        cleans up spaces after decoding (then `decode` of the whole list is the only exact way)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return None

        def new_step() -> Callable[[int], Optional[str]]:
            stream = DecodeStream(skip_special_tokens=True)
            return lambda token_id: stream.step(backend, token_id)

        return new_step

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise bad_request(f"Token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1}).", param=param)

    # ---- token bytes --------------------------------------------------------------------------------------------
    @property
    def token_bytes(self) -> List[Optional[bytes]]:
        with self._lock:
            if self._token_bytes is None:
                self._token_bytes = self._build_token_bytes()
            return self._token_bytes

    def _build_token_bytes(self) -> List[Optional[bytes]]:
        tok = self.tokenizer
        special = set(int(i) for i in tok.all_special_ids)
        for index, added in getattr(tok, "added_tokens_decoder", {}).items():
            if getattr(added, "special", False):
                special.add(int(index))
        decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
        byte_level = type(decoder).__name__ == "ByteLevel"
        pieces = tok.convert_ids_to_tokens(list(range(self.vocab_size)))
        table: List[Optional[bytes]] = []
        for index, piece in enumerate(pieces):
            if index in special or piece is None:
                table.append(None)
            elif byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
                table.append(bytes(_UNICODE_TO_BYTE[c] for c in piece))
            else:
                table.append(tok.decode([index]).encode("utf-8"))
        return table

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """llguidance's tokenizer (for `swarm.client.decoding.grammar` constraints), built on first use."""
        with self._lock:
            if self._grammar_tokenizer is None:
                eos = self.tokenizer.eos_token_id
                self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.vocab_size,
                                                           int(eos) if eos is not None else None)
            return self._grammar_tokenizer

    def token_string(self, token_id: int) -> str:
        data = self.token_bytes[token_id]
        if data is None:
            return self.tokenizer.convert_ids_to_tokens(token_id) or ""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def token_byte_list(self, token_id: int) -> Optional[List[int]]:
        data = self.token_bytes[token_id]
        return list(data) if data is not None else None
