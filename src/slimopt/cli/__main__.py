"""``python -m slimopt.cli`` (and ``torchrun ... -m slimopt.cli``): the ``slimopt`` command."""

import sys

from slimopt.cli import main

sys.exit(main())
