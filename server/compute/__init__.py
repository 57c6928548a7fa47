"""Running a span of blocks: loading it, batched decode and prefill, CUDA graphs, the KV cache and its arena."""
