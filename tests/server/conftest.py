"""Fixtures for the HTTP server tests (helpers live in tests/server/helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.helpers import ServerProcess, managed, start_server


@pytest.fixture(scope="session")
def server_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def tiny_model_ready(tiny_model_path: Path) -> Path:
    """Build the tiny checkpoint once here, so server processes don't race to make it."""
    return tiny_model_path


@pytest.fixture(scope="session")
def server(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    """The tiny model behind the default options, shared by the API tests that need no other
    (a module that does defines its own `server`)."""
    yield from managed(start_server(server_tmp, "--no-warmup", "--no-startup-profile"))


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=120)
