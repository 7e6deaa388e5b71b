"""``python -m rltrain.report PATH...`` (see rltrain.report.cli)."""

import sys

from rltrain.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
