"""What ``unison --help`` and the ``--help`` of train, plan and check say about the command (the other commands'
descriptions are the first lines of their modules' docstrings). Written for a user: what the command does and what
it gives, in the words of the options; wrapped by hand for ``argparse.RawDescriptionHelpFormatter``."""

DESCRIPTION = ("Self-supervised pre-training of image encoders, on one machine or a cluster. Training on W workers "
               "with a batch of B/W images each is mathematically the same as one worker with the batch of B, for "
               "every method; `unison check` proves it.")
EPILOG = ("Start with `unison train` (SimCLR on the embedded digits, then a kNN accuracy against the random "
          "encoder). `unison COMMAND --help` lists a command's options and their defaults.")

TRAIN = """Self-supervised pre-training: W workers with B/W images each, exactly
equivalent to 1 worker with the global batch B.

The run directory (--out) is the run's own output: one run at a time
(a second one is refused while the first lives), never inside the data,
and a resume never overwrites checkpoints later than the one it starts
from (pass a new --out to branch)."""

PLAN = """What a `unison train` run with these options needs on each GPU, before
you book them: peak memory, the largest batch per GPU that fits --gpu,
FLOPs, bytes communicated and host synchronisations per step, and an
estimate of the step time and images/s. The step is simulated on this
machine (no GPU needed, nothing the size of the model is allocated).
Exit 0 when the run fits, 1 when it does not."""

CHECK = """Train the step `unison train` runs for --method on W worker processes
(B/W images each) and in one process on the global batch B, and compare
the losses, gradients and parameters step by step; exit 1 when they
differ. --run compares whole `unison train` runs at 1 and W workers
(their loss curves)."""
