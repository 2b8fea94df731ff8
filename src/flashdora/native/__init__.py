"""Everything that knows the C++ extension: its build (``build``), the layer path's calls into it (``bridge``) and
its source (``native/csrc/``). docs/design.md, "The C++ extension", says when it is built and which calls it takes."""

from flashdora.native.build import built, directory, enabled, failed, load, loaded, name, reset

__all__ = ["built", "directory", "enabled", "failed", "load", "loaded", "name", "reset"]
