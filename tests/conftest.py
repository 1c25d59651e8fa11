"""Fixtures shared by the test modules (helpers live in spec_helpers.py and server_helpers.py)."""

from __future__ import annotations

import pytest
from spec_helpers import assets, one_thread


@pytest.fixture(scope="module")
def single_thread():
    """For a whole module: torch on one thread (see spec_helpers.one_thread)."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny targets and drafters of spec_helpers.assets, built once per session."""
    return assets(tmp_path_factory)
