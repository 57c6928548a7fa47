"""Structured-output benchmark: the cost per token of a grammar constraint (llguidance) in the sampler.

With the bundled model's tokenizer (49k tokens) and no swarm: for a JSON Schema (`response_format` json_schema), any
JSON object (json_object) and a forced tool call (`gateway.structured.tools.tool_grammar`), a `Sampler` with the grammar
picks tokens from random logits until the document is complete; the same picks without a constraint are the baseline.
Prints one JSON object: per grammar, the median and p95 time per token of mask + pick + consume, the unconstrained
pick's, the compile time (matcher creation), and the building of llguidance's tokenizer (once per gateway).

Usage (from the repository root): .venv/bin/python bench/bench_grammar.py [--docs N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from gateway.schemas import ToolDefinition  # noqa: E402
from gateway.structured.tools import tool_grammar  # noqa: E402
from swarm.client.decoding.grammar import GrammarConstraint, GrammarTokenizer, json_schema_grammar  # noqa: E402
from swarm.client.decoding.sampling import Sampler, SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
TOOL = ToolDefinition(type="function", function={"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}})


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(tokenizer, grammar_tokenizer, grammar: str, docs: int, limit: int = 200) -> Dict[str, float]:
    vocab = len(tokenizer)
    constrained: List[float] = []
    free: List[float] = []
    compiles: List[float] = []
    for seed in range(docs):
        start = time.perf_counter()
        constraint = GrammarConstraint(grammar_tokenizer, grammar)
        compiles.append(time.perf_counter() - start)
        params = SamplingParams(max_tokens=limit, temperature=1.0, seed=seed)
        sampler, plain = Sampler(params, 1, vocab, constraint=constraint), Sampler(params, 1, vocab)
        generator = torch.Generator().manual_seed(seed)
        ids = [1]
        for _ in range(limit):
            logits = torch.randn(vocab, generator=generator) * 3
            start = time.perf_counter()
            plain.choose(torch.tensor(ids), logits, limit)
            free.append(time.perf_counter() - start)
            start = time.perf_counter()
            ids.append(sampler.choose(torch.tensor(ids), logits, limit).token_id)
            constrained.append(time.perf_counter() - start)
            if constraint.complete:
                break
    return {"tokens": len(constrained), "ms_per_token_median": 1e3 * statistics.median(constrained),
            "ms_per_token_p95": 1e3 * percentile(constrained, 0.95),
            "unconstrained_ms_per_token_median": 1e3 * statistics.median(free),
            "compile_ms_median": 1e3 * statistics.median(compiles)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=5, help="documents generated per grammar")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from swarm.modeling.prepare import prepare_model

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(prepare_model()))
    start = time.perf_counter()
    grammar_tokenizer = GrammarTokenizer(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    built = time.perf_counter() - start
    grammars = {"json_schema": json_schema_grammar(SCHEMA), "json_object": json_schema_grammar({"type": "object"}),
                "forced_tool_call": tool_grammar([TOOL], "get_weather", False)}
    results = {name: run(tokenizer, grammar_tokenizer, g, args.docs) for name, g in grammars.items() if g}
    print(json.dumps({"bench": "grammar", "vocab": len(tokenizer), "tokenizer_build_s": built, **results}))


if __name__ == "__main__":
    main()
