"""What several test modules share (no tests here): built engines, launched servers, the tokenizer's
fixtures, model-repository stand-ins. pytest puts tests/ on the import path, as it does for
conftest.py, so test modules import `support.…`."""
