"""``python -m tidal.store serve|volume|ls``."""

import sys

from tidal.store.cli import main

sys.exit(main())
