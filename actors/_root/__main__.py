"""``python -m greenroom`` is the ``greenroom`` command."""

import sys

from greenroom.actors.apps.cli import main

sys.exit(main())
