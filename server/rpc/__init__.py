"""A block server's RPCs: the inference, forward, push and training handlers and their limits."""
