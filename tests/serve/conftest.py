"""Fixtures for the serving tests (helpers live in serve_helpers.py)."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    """Every test here runs with one intra-op thread (the root conftest's ``one_thread``)."""
