"""``python -m veloxquant_mlx``: the ``veloxquant`` command line."""

import sys

from .cli import main

sys.exit(main())
