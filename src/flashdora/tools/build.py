"""``flashdora build``: build the C++ extension into torch's extension cache ahead of training (a Docker image, a
CI job), so that the first training call only loads it."""

from __future__ import annotations

import sys


def run(args) -> int:
    from flashdora import native

    if not native.enabled():
        print("flashdora build: the C++ extension is switched off (FLASHDORA_NATIVE=0, or private internals off on "
              "an untested torch or Triton): nothing to build", file=sys.stderr)  # fmt: skip
        return 1
    cached = native.built()
    if native.load() is None:
        print("flashdora build: the build failed (see the warning above); training runs the Triton route",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"flashdora build: {native.name()} {'was already' if cached else 'is now'} built in {native.directory()}")
    return 0
