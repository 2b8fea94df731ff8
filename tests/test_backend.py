import pytest
import torch

from flashdora import backend, config, dora_linear, reset_stats, stats
from tests.helpers import dora_inputs


def test_default_is_auto(monkeypatch):
    monkeypatch.delenv("FLASHDORA_BACKEND", raising=False)
    assert backend.requested_backend() == "auto"


@pytest.mark.parametrize("value", ["eager", "TRITON", " auto "])
def test_known_values(monkeypatch, value):
    monkeypatch.setenv("FLASHDORA_BACKEND", value)
    assert backend.requested_backend() == value.strip().lower()


def test_unknown_value_is_a_clear_error(monkeypatch):
    """A bad value is refused where the settings are read (at import in a new process, at ``reload``), naming the
    variable and the value; the settings keep their last good values."""
    with pytest.raises(ValueError, match="FLASHDORA_BACKEND expected one of auto, triton, eager, got 'cuda-graphs'"):
        monkeypatch.setenv("FLASHDORA_BACKEND", "cuda-graphs")
    assert config.backend == "auto"


def test_auto_on_cpu_is_eager(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "auto")
    assert not backend.use_triton(torch.zeros(1))


def test_eager_never_uses_triton(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "eager")
    assert not backend.use_triton(torch.zeros(1))


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not backend.triton_available():
        with pytest.raises(RuntimeError, match="triton is not importable"):
            backend.use_triton(torch.zeros(1))
    else:
        with pytest.raises(RuntimeError, match=r"needs CUDA tensors .* got devices \['cpu'\]"):
            backend.use_triton(torch.zeros(1))


def test_triton_without_triton_is_an_error(monkeypatch):
    monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="triton is not importable"):
        backend.use_triton(torch.zeros(1))
    monkeypatch.setenv("FLASHDORA_BACKEND", "auto")
    assert not backend.use_triton(torch.zeros(1))


def test_stats_and_reset():
    reset_stats()
    backend.count("eager")
    backend.count("peft_fallback:conv", 2)
    assert stats() == {"eager": 1, "peft_fallback:conv": 2}
    snapshot = stats()
    snapshot["eager"] = 99
    assert stats()["eager"] == 1
    reset_stats()
    assert stats() == {}


def test_warn_once():
    with pytest.warns(UserWarning, match="only once"):
        backend.warn_once("test-key-unique", "only once")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend.warn_once("test-key-unique", "only once")


def test_float64_stays_eager(monkeypatch):
    # The kernels compute in float32; float64 (references, gradcheck) must keep float64 accuracy.
    x = torch.zeros(2, dtype=torch.float64)
    monkeypatch.setenv("FLASHDORA_BACKEND", "auto")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    monkeypatch.setattr(backend, "current_cuda_device", lambda: torch.zeros(1).get_device())
    assert backend.use_triton(torch.zeros(2)) and not backend.use_triton(x)
    monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="float64 runs eager"):
        backend.use_triton(x)


def test_settings_are_read_once_and_changed_by_configure(monkeypatch):
    """The environment is read at import (``reload``), not per call; ``flashdora.configure`` changes a setting at
    run time and names a bad argument; ``override`` restores."""
    import os

    import flashdora
    from flashdora.ops.norm_cache import cache_enabled

    monkeypatch.setitem(os.environ, "FLASHDORA_NORM_CACHE", "0")  # (plain setitem: no reload)
    assert cache_enabled() and backend.requested_backend() == "auto"
    assert config.reload()["norm_cache"] is False and not cache_enabled()
    before = flashdora.configure(backend="eager", norm_cache=True)
    assert before["backend"] == "auto" and not before["norm_cache"]
    assert backend.requested_backend() == "eager" and cache_enabled()
    with config.override(backend="triton"):
        assert backend.requested_backend() == "triton"
    assert backend.requested_backend() == "eager"
    with pytest.raises(ValueError, match="configure: backend expected one of auto, triton, eager, got 'cuda'"):
        flashdora.configure(backend="cuda")
    with pytest.raises(ValueError, match="configure: native expected one of True, False, got '0'"):
        flashdora.configure(native="0")
    with pytest.raises(TypeError, match="configure: unknown setting 'nativ'; expected one of backend, native"):
        flashdora.configure(nativ=False)
    assert backend.requested_backend() == "eager"  # (nothing changed by a refused call)


@pytest.mark.gpu
def test_tensors_off_the_current_device_run_eager(monkeypatch):
    """CUDA tensors on a device other than the current one (layers spread over GPUs in one process) run the eager
    path under ``auto``, warned once, with the same values; ``triton`` refuses them with a named error. One GPU
    plays a second by reporting another current device."""
    monkeypatch.delenv("FLASHDORA_BACKEND", raising=False)
    monkeypatch.setattr(backend, "_warned", set())
    i = dora_inputs(64, 48, 8, device="cuda")
    args = (i["x"], i["weight"], i["bias"], i["lora_A"], i["lora_B"], i["magnitude"], i["scaling"])
    reset_stats()
    ref = dora_linear(*args)
    assert stats().get("triton") == 1
    monkeypatch.setattr(backend, "current_cuda_device", lambda: i["x"].get_device() + 1)
    reset_stats()
    with pytest.warns(UserWarning, match=r"tensors on cuda:0 while cuda:1 is the current device"):
        out = dora_linear(*args)
    assert stats().get("eager") == 1 and "triton" not in stats()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    with pytest.raises(RuntimeError, match=r"FLASHDORA_BACKEND=triton: tensors on cuda:0 while cuda:1"):
        dora_linear(*args)


@pytest.mark.parametrize(
    "name, setting",
    [
        ("FLASHDORA_NORM_CACHE", "norm_cache"),
        ("FLASHDORA_NATIVE", "native"),
        ("FLASHDORA_STATIC_LAUNCH", "static_launch"),
    ],
)
def test_switches_reject_unknown_values(name, setting, monkeypatch):
    """Every on/off switch takes the documented spellings, defaults when unset or empty, and names itself and the
    value it got for anything else (a typo never silently picks a default)."""
    for value, expected in [("1", True), ("Yes", True), (" on ", True), ("0", False), ("off", False), ("", True)]:
        monkeypatch.setenv(name, value)
        assert config.current()[setting] is expected
    with pytest.raises(ValueError, match=rf"{name} expected one of .* got 'of'"):
        monkeypatch.setenv(name, "of")


def test_untested_versions_take_the_plain_launch(monkeypatch):
    """On a torch or Triton the tests do not cover, no private internals: every kernel launches as ``kernel[grid]``,
    the C++ compose stays off and the autograd helpers fall back; the results are the same."""
    from flashdora import native
    from flashdora.kernels import launcher
    from flashdora.ops import compose

    monkeypatch.setenv("FLASHDORA_BACKEND", "triton")
    i = dora_inputs(40, 24, 8, device="cpu")
    args = (i["x"], i["weight"], i["bias"], i["lora_A"], i["lora_B"], i["magnitude"], i["scaling"])
    ref = dora_linear(*args)
    assert backend.tested_versions()  # this suite's versions (torch 2.13 CPU, triton 3.9; torch 2.11 on the GPUs)
    assert config._minor("2.11.0+cu130") == (2, 11) and config._minor("3.10.0") == (3, 10)
    monkeypatch.setattr(launcher, "_TUNED", _Refusing())  # the fast path's table: never read on the plain path
    for untested in ("versions", "switch"):
        with monkeypatch.context() as m:
            if untested == "versions":
                m.setattr(config, "tested_versions", lambda: False)
                config.reload()
            else:
                m.setenv("FLASHDORA_PRIVATE_APIS", "0")
            out = dora_linear(*args)
            with torch.enable_grad():
                assert not native.enabled() and compose.after_base() == -1
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


class _Refusing(dict):
    def get(self, *args):
        raise AssertionError("the fast launch path ran on an untested version")


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("backend", "TRITON", "auto, triton, eager"),
        ("backend", " eager", "auto, triton, eager"),
        ("backend", "", "auto, triton, eager"),
        ("backend", None, "auto, triton, eager"),
        ("backend", True, "auto, triton, eager"),
        ("native", 1, "True, False"),
        ("norm_cache", 0, "True, False"),
        ("private_apis", "off", "True, False"),
        ("static_launch", None, "True, False"),
        ("autotune", 1.0, "True, False"),
        ("double_backward", torch.tensor(True), "True, False"),
    ],
)  # fmt: skip
def test_configure_accepts_only_documented_values(name, value, allowed):
    """``configure`` takes only the values its docstring lists (a backend's name as written, ``True`` or ``False``
    for a switch): anything else is a ``ValueError`` naming the setting and the allowed values, and changes
    nothing."""
    import flashdora

    before = config.current()
    with pytest.raises(ValueError, match=f"configure: {name} expected one of {allowed}, got"):
        flashdora.configure(**{name: value})
    assert config.current() == before
    for good in config.BACKENDS if name == "backend" else (True, False):
        with config.override(**{name: good}):
            assert config.current()[name] == good
