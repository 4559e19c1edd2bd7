"""`python -m core.cli ...` (what torchrun's ranks run): the `zoo` command."""

import sys

from core.cli.commands import main

sys.exit(main())
