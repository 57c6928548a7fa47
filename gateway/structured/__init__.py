"""Structured output and tools: tools in the prompt, tool calls parsed from the output, and the grammar that constrains
a request's decoding."""
