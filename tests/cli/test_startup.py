"""What a process imports when it starts: the CLI's ``--help`` path imports no torch, and the training modules
(what the launcher's parent process and ``unison eval`` import) import neither FSDP2 nor torch.distributed.checkpoint
(with DTensor, about 0.8 s here); the sharded paths import them where they are used. Fresh interpreters: this
process has imported them all."""

import subprocess
import sys

PROBE = ("import sys, {module}; print(' '.join(m for m in ({watched}) if m in sys.modules))")
HEAVY = ("'torch.distributed.checkpoint'", "'torch.distributed.fsdp'", "'torch.distributed.tensor'")


def imported(module: str, watched: tuple[str, ...]) -> list[str]:
    code = PROBE.format(module=module, watched=", ".join(watched) + ",")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def test_the_cli_imports_no_torch_until_a_command_needs_it():
    assert imported("unison.cli", ("'torch'",)) == []


def test_the_training_modules_import_neither_fsdp_nor_distributed_checkpoint():
    assert imported("unison.training.trainer, unison.training.step, unison.training.checkpoint", HEAVY) == []


def test_the_sharded_paths_still_import_them():
    assert imported("unison.parallel.fsdp", HEAVY[1:2]) == ["torch.distributed.fsdp"]
    assert imported("unison.training.checkpoint.dcp", HEAVY[:1]) == ["torch.distributed.checkpoint"]
