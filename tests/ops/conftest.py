"""Fixtures of the ops tests."""

import pytest

from tests.helpers import native_extension


@pytest.fixture(scope="module")
def ext():
    return native_extension()
