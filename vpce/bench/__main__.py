"""``python -m vpce.bench``: see ``vpce.bench`` for what is measured and how."""

import sys

from .cli import main

sys.exit(main())
