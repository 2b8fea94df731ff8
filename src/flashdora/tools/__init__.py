"""flashdora's tools, apart from the library: the command line (``cli``), ``demo``, ``parity`` and ``bench``."""
