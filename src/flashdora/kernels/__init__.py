"""Triton kernels. Importable without CUDA or Triton: ``HAS_TRITON`` says whether they can be launched.

Kernels trust their inputs (``ops/`` validates); set ``TRITON_INTERPRET=1`` before importing to run them on CPU.
"""

try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the platform
    HAS_TRITON = False
