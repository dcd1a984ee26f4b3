"""Fixtures for the HTTP server tests (helpers live in tests/server/helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def server_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def tiny_model_ready(tiny_model_path: Path) -> Path:
    """Build the tiny checkpoint once here, so server processes don't race to make it."""
    return tiny_model_path
