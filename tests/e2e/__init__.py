"""End-to-end tests: swarms of real processes against local transformers."""
