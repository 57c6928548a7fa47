"""swarmgate's tests; `tests/conftest.py` and `tests/fixtures/` hold the shared fixtures."""
