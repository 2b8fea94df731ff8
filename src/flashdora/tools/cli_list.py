"""``ListAction``: an argparse action for list options (``flashdora bench serve``'s ``--adapters``, ``--ranks``,
``--modes``)."""

from __future__ import annotations

import argparse


class ListAction(argparse.Action):
    """A list option given as ``1,4,16``, ``1 4 16`` or both: integers (``integers=True``) or names from ``allowed``,
    checked here so that an error names the option, commas or not; a value given twice is an error."""

    def __init__(self, *args, integers: bool = False, allowed: tuple[str, ...] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.integers, self.allowed = integers, allowed

    def __call__(self, parser, namespace, values, option_string=None):
        items = [v for text in values for v in text.split(",") if v]
        if self.integers:
            try:
                items = [int(v) for v in items]
            except ValueError:
                raise argparse.ArgumentError(
                    self, f"expected integers such as 1,4,16, got {' '.join(values)!r}"
                ) from None
        bad = [v for v in items if self.allowed is not None and v not in self.allowed]
        if bad:
            raise argparse.ArgumentError(self, f"invalid choice {bad[0]!r} (choose from {', '.join(self.allowed)})")
        twice = [v for i, v in enumerate(items) if v in items[:i]]
        if not items or twice:
            raise argparse.ArgumentError(self, f"{twice[0]!r} given twice" if twice else "expected values")
        setattr(namespace, self.dest, items)
