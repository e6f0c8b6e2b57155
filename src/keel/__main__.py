"""``python -m keel`` runs the CLI."""

import sys

from keel.cli import main

sys.exit(main())
