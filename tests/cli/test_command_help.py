"""The commands' help and start-up as a user meets them: `--help` lists methods, parameters and presets and says each
default once, each `unison bench` part has its own help, help, --version and a mistyped option import no torch, and
a stop while `unison train` starts up is one line and exit 75."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from unison.cli import main
from unison.config.distributed import gpu_device_node_found

_STOP_WHILE_THE_COMMAND_STARTS = """
import os
import signal
import sys

import unison.cli as cli

original = getattr(cli, sys.argv[2])


def then_stop(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)   # a cluster's stop while the command starts
    return original(*args, **kwargs)


setattr(cli, sys.argv[2], then_stop)
sys.exit(cli.main(["train", "--out", sys.argv[1], "--max-steps", "1", "--world-size", "1", "--no-progress"]))
"""


def test_help_lists_methods_params_presets_and_says_defaults_once(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "default: method recipe" in text and "(default: None)" not in text
    for fragment in ("simclr       temperature=0.5", "dino ", "momentum_base=0.99", "augmentation presets",
                     "multicrop", "timm:<model>", "examples/configs/simclr_cifar10.yaml"):
        assert fragment in text, fragment
    for command in (["eval"], ["export", "--out", "x.pt"]):
        with pytest.raises(SystemExit) as info:
            main(command)
        assert info.value.code == 2
        assert "the following arguments are required: --checkpoint" in capsys.readouterr().err


def test_each_bench_part_has_its_own_help(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "lightly", "--help"])
    text = capsys.readouterr().out
    assert "--lightly-steps" in text and "--comm-steps" not in text and "--scaling-steps" not in text
    assert f"{sys.executable}-mpipinstall'lightly>=1.5'" in "".join(text.split())   # as wrapped, without spaces
    assert "(default: cores / workers) (default:" not in text
    with pytest.raises(SystemExit):
        main(["bench", "comm", "--help"])
    text = capsys.readouterr().out
    assert "--comm-steps" in text and "--lightly-steps" not in text


def test_bench_lightly_without_lightly_says_what_to_install(capfd, monkeypatch):
    # the suite installs Lightly (its benchmark sides are tested): hide it, as on a machine without it
    for name in [m for m in sys.modules if m == "lightly" or m.startswith("lightly.")] + ["lightly"]:
        monkeypatch.setitem(sys.modules, name, None)   # `import lightly` then raises ImportError
    assert main(["bench", "lightly"]) == 2
    err = capfd.readouterr().err
    assert "bench lightly needs Lightly SSL" in err and f"{sys.executable} -m pip install 'lightly>=1.5'" in err


def test_the_peer_comparisons_without_the_lab_are_one_line_and_bench_all_leaves_them_out(capfd, monkeypatch):
    """unison installed from a wheel has no benchmarks/lab: `bench lightly` and `bench race` say where they run,
    whatever their flags (--help too), and `bench all` runs the other parts."""
    from unison.bench import lab

    monkeypatch.setattr(lab, "LAB", lab.REPO_ROOT / "no_such_folder" / "lab")
    for argv in (["bench", "lightly"], ["bench", "lightly", "--method", "byol", "--lightly-steps", "3"],
                 ["bench", "race", "--help"]):
        assert main(argv) == 2, argv
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"unison: error: bench {argv[1]} runs from a clone of the "
                                                        "repository: the peer comparisons"), err
    assert main(["bench", "all", "--dry-run", "--data", "cifar10", "--val", "cifar10"]) == 0
    captured = capfd.readouterr()
    assert "bench all leaves it out" in captured.err and "# table" in captured.out, captured
    assert "# lightly" not in captured.out and "lightly-cmp" not in captured.out and "Lightly SSL side" not in captured.out
    with pytest.raises(SystemExit):
        main(["bench", "all", "--help"])
    assert "--lightly-steps" not in capfd.readouterr().out


def test_help_version_and_a_mistyped_option_import_no_torch():
    """`unison --help` and `--version` list every subcommand without importing torch (seconds): only the
    subcommand being run is imported, the version reads no torch module, and train's epilog (the registries) is
    made only for ``train --help``, so a mistyped option's error comes at once (0.3 s, not 2.6 s). So does a value
    out of its range, where no GPU device node says that torch must be asked whether CUDA is there."""
    probe = ("import sys\nfrom unison.cli import main\n"
             "for argv in (['--help'], ['--version'], ['train', '--batch-size', 'x'], None,\n"
             "             ['train', '--epochs', '-1'], ['train', '--world-size', '2', '--batch-size', '3']):\n"
             "    if argv is None:\n        print('torch' in sys.modules, file=sys.stderr)\n        continue\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print('torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *_, before, epochs, batch, after = proc.stderr.strip().splitlines()
    assert before == "False", proc.stderr
    assert epochs == "unison: error: epochs=-1 must be an integer >= 1 and <= 1000000000", proc.stderr
    assert batch.startswith("unison: error: batch_size=3 (global) cannot be split evenly over world_size=2"), batch
    assert after == str(gpu_device_node_found()), proc.stderr   # no GPU device node: torch not asked, not imported
    for name in ("train", "plan", "check", "eval", "embed", "export", "plot", "bench"):
        assert name in proc.stdout
    assert "unison train: error: argument --batch-size: invalid int value: 'x'" in proc.stderr, proc.stderr
    assert re.search(r"unison \S+ \(torch \d+\.\d+", proc.stdout)


@pytest.mark.parametrize("moment", ["make_parser", "build_train_config"])
def test_a_stop_while_train_starts_up_is_one_line_and_exit_75(moment, tmp_path):
    """While train builds its parser (a second) and reads its options, SIGTERM's default ended the command with
    143 and no line: a job script that requeues on 75 would not have requeued it."""
    script = tmp_path / "stop_at_start.py"
    script.write_text(_STOP_WHILE_THE_COMMAND_STARTS)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), moment], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 75, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines()[-1] == ("unison: error: stopped by SIGTERM before training started: "
                                                     "nothing to save; run the same command again"), proc.stderr
