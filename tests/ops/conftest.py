"""Fixtures of the ops tests."""

import pytest

from flashdora import native


@pytest.fixture(scope="module")
def ext():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHDORA_NATIVE", "1")
        native.reset()
        mod = native.module()
    native.reset()
    if mod is None:
        pytest.skip("the C++ extension cannot be built here (no compiler?)")
    return mod
