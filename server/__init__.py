"""A block server: loading, execution, KV cache, scheduling, block placement, RPC handlers and its CLI."""
