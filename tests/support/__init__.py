"""Helpers the tests share that are not fixtures (``tests/`` is on ``sys.path`` through conftest)."""
