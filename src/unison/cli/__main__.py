"""``python -m unison.cli``: what torchrun, srun and mpirun start (the ``unison`` command without its script)."""

import sys

from unison.cli import main

sys.exit(main())
