"""Fixtures shared by the test modules (helpers live in spec_helpers.py and server_helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch
from spec_helpers import assets, one_thread


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs a worker per core), each worker's torch gets its share
    of the cores: two workers with two spinning threads each on two cores run several times slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(scope="module")
def single_thread():
    """For a whole module: torch on one thread (see spec_helpers.one_thread)."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny targets and drafters of spec_helpers.assets, built once per session."""
    return assets(tmp_path_factory)
