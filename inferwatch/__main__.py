"""``python -m inferwatch``: the same as the ``inferwatch`` command."""

import sys

from inferwatch.cli import main

sys.exit(main())
