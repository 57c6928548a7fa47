"""Structured output: constraining token choices to a grammar with llguidance.

A grammar is llguidance's text form: a Lark grammar (which may embed JSON Schemas with `%json {...}`) or the JSON
grammar that `json_schema_grammar(schema)` compiles from a JSON Schema (`regex_grammar`, `choice_grammar` and
`lark_grammar`, which also takes GBNF, for vLLM's guided decoding). `GrammarTokenizer` (one per tokenizer, built
once: ~0.4 s for a 49k vocabulary) holds llguidance's view of a Hugging Face fast tokenizer; `check_grammar` says why a
grammar cannot be used ("" when it can). `GrammarConstraint` is one sequence's matcher, the `TokenConstraint` that
`swarm.client.decoding.sampling.Sampler` applies: `mask()` is the [vocab] bool of the tokens that may come next
(llguidance computes it in Rust, ~0.1 ms a token here), `advance(token)` consumes the chosen one, `complete` tells when
the grammar cannot continue (the document is closed; the end-of-sequence token is then the only one allowed).
JSON is written compactly with one space after `,` and `:` (no free whitespace: a small model cannot pad forever).
`closed_schema(schema, strict)` closes a JSON Schema's objects before it is compiled: no key the schema does not
declare is ever written (with `strict`, OpenAI's strict mode, also every declared key is).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

import torch

JSON_STYLE: Dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_grammar(schema: Dict[str, Any]) -> str:
    """llguidance's grammar for the JSON documents that `schema` accepts, in the compact style above. ValueError for a
    schema that is not a JSON object."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=dict(JSON_STYLE))  # type: ignore[arg-type]


# Where subschemas sit (the rest, `const`, `enum`, `default`, `examples`..., is data and never rewritten).
_OWN_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> a schema of its own
_OWN = ("items", "additionalItems", "contains", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
        "propertyNames")  # a schema (or, for draft-4 `items`, a list) of other values than the instance
_ALTERNATIVES = ("anyOf", "oneOf")  # each branch is the whole instance's schema
_CONJUNCTIVE = ("allOf", "then", "else", "dependentSchemas", "not", "if", "$ref")  # validate the same instance too
_OTHER_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _is_object(node: Dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


def closed_schema(schema: Dict[str, Any], strict: bool = False) -> Dict[str, Any]:
    """`schema` with its objects closed, for the grammar: an object schema that declares `properties` and says nothing
    about other keys (`additionalProperties`, `patternProperties`, `unevaluatedProperties`) gets
    `additionalProperties: false`, so the model never invents a key (the output still validates against `schema`;
    `{"type": "object"}` alone stays any object). Not closed, as that would change what validates: a schema combined
    with others on the same instance (`allOf`, `$ref` siblings, `if`/`then`/`else`, `not`, `dependentSchemas`), and
    `anyOf`/`oneOf` branches of an object that declares properties itself.

    `strict` (OpenAI's strict mode): every object schema is closed and every property it declares is required;
    ValueError where that cannot hold (an object that allows other keys, or that is combined as above, a schema
    without a type that could be an object with any keys)."""

    def walk(node: Any, closable: bool, where: str) -> Any:
        if isinstance(node, bool) or not isinstance(node, dict):
            if strict and node is True:
                raise ValueError(f"strict: the schema at {where} allows any value")
            return node
        out: Dict[str, Any] = {}
        own_keys = any(k in node for k in ("properties", *_OTHER_KEYS))
        for key, value in node.items():
            at = f"{where}/{key}"
            if key in _OWN_MAPS and isinstance(value, dict):
                out[key] = {k: walk(v, True, f"{at}/{k}") for k, v in value.items()}
            elif key in _OWN and isinstance(value, list):
                out[key] = [walk(v, True, f"{at}/{i}") for i, v in enumerate(value)]
            elif key in _OWN or key == "prefixItems":
                out[key] = ([walk(v, True, f"{at}/{i}") for i, v in enumerate(value)] if isinstance(value, list)
                            else walk(value, True, at))
            elif key in _ALTERNATIVES and isinstance(value, list):
                out[key] = [walk(v, not own_keys, f"{at}/{i}") for i, v in enumerate(value)]
            elif key in _CONJUNCTIVE:
                if strict and key != "$ref":
                    raise ValueError(f"strict: '{key}' at {where} is not supported (as in OpenAI's strict mode)")
                maps = key == "dependentSchemas" and isinstance(value, dict)
                out[key] = ({k: walk(v, False, f"{at}/{k}") for k, v in value.items()} if maps
                            else [walk(v, False, f"{at}/{i}") for i, v in enumerate(value)] if isinstance(value, list)
                            else walk(value, False, at) if isinstance(value, dict) else value)
            else:
                out[key] = value
        combined = any(k in node for k in _CONJUNCTIVE)
        if strict:
            typed = any(k in node for k in ("type", "const", "enum", "$ref", *_ALTERNATIVES))
            if not typed:
                raise ValueError(f"strict: the schema at {where} has no type (it would allow any value)")
            if _is_object(node):
                if not closable or combined:
                    raise ValueError(f"strict: the object at {where} cannot be closed here")
                if any(k in node and node[k] is not False for k in _OTHER_KEYS):
                    raise ValueError(f"strict: the object at {where} allows undeclared keys "
                                     f"(additionalProperties must be false or absent)")
                out["additionalProperties"] = False
                names: List[str] = list(out.get("properties", {}))
                out["required"] = names + [k for k in out.get("required", []) if k not in names]
        elif closable and not combined and "properties" in node and not any(k in node for k in _OTHER_KEYS):
            out["additionalProperties"] = False
        return out

    return walk(schema, True, "#")


def regex_grammar(regex: str) -> str:
    """llguidance's grammar for the texts that fully match `regex` (Rust regex syntax)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_regex(regex)


def choice_grammar(choices: Sequence[str]) -> str:
    """A grammar for exactly one of `choices`."""
    return "start: " + " | ".join(json.dumps(c) for c in choices) + "\n"


def lark_grammar(text: str) -> str:
    """A grammar given as Lark (llguidance's dialect) or as GBNF (llama.cpp's, converted)."""
    from llguidance.gbnf_to_lark import any_to_lark

    return any_to_lark(text)


def styled_schema(schema: Dict[str, Any]) -> str:
    """`schema` as the text of a Lark `%json` rule body, carrying the compact style (`x-guidance`)."""
    return json.dumps({**schema, "x-guidance": dict(JSON_STYLE)})


class GrammarTokenizer:
    """llguidance's tokenizer for a Hugging Face fast tokenizer; `vocab_size` rows in the masks."""

    def __init__(self, hf_tokenizer, vocab_size: Optional[int] = None, eos_token_id: Optional[int] = None):
        import llguidance.hf

        self.vocab_size = vocab_size or len(hf_tokenizer)
        self.inner = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos_token_id)
        self._bits = torch.arange(32, dtype=torch.int32)


def check_grammar(tokenizer: GrammarTokenizer, grammar: str) -> str:
    """Why `grammar` cannot constrain generation ("" when it can): syntax errors, unsupported JSON Schema keywords.
    Warnings count (a keyword llguidance would ignore could let through output that does not validate)."""
    import llguidance

    try:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer.inner)
    except Exception as e:  # llguidance raises for text that is no grammar at all
        return str(e)
    return "; ".join(messages) or "invalid grammar" if failed or messages else ""


class GrammarConstraint:
    """One sequence's position in `grammar` (the text generated so far is a valid prefix of a document)."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str):
        import llguidance

        self.tokenizer = tokenizer
        self.matcher = llguidance.LLMatcher(tokenizer.inner, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"invalid grammar: {self.matcher.get_error()}")
        self._words = (tokenizer.vocab_size + 31) // 32
        self._bitmask = torch.zeros((1, self._words), dtype=torch.int32)

    @property
    def complete(self) -> bool:
        """The grammar cannot go on: the document is finished (or the end-of-sequence token was consumed)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a whole document (it may still be extended)."""
        return self.matcher.is_accepting()

    def mask(self) -> torch.Tensor:
        """[vocab] bool: the tokens that keep the text a valid prefix (end-of-sequence where it may end)."""
        # what llguidance.torch.fill_next_token_bitmask does, without importing that module (it sets up
        # torch.compile for a GPU kernel: seconds of imports on the first structured request)
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._words * 4)
        bits = (self._bitmask[0, :, None] >> self.tokenizer._bits) & 1  # [words, 32]
        return bits.reshape(-1)[: self.tokenizer.vocab_size].bool()

    def advance(self, token_id: int) -> None:
        if not self.matcher.consume_token(int(token_id)):
            raise ValueError(f"token {token_id} does not continue the constrained text: {self.matcher.get_error()}")

    def rollback(self, tokens: int) -> None:
        """Undo the last `tokens` advances (a retracted pick: the grammar's position as it was then)."""
        self.matcher.rollback(tokens)
