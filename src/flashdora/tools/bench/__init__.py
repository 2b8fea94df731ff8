"""Benchmarks behind ``flashdora bench layer|model``: one timer (``timing``), one result format (``record``)."""
