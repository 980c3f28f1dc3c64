"""``python -m unison.cli``: what torchrun, srun and mpirun start (the ``unison`` command without its script)."""

import sys

try:
    from unison.cli import main
except KeyboardInterrupt:   # Ctrl-C in the first instant: the same line as later
    print("unison: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
