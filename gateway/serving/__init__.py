"""Running generations: the engine's worker threads, a request's run, sessions and their pool, events, text streams, the
tokenizer side, spot-check hold-back."""
