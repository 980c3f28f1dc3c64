"""Numbers as recipes write them (``1e9`` epochs, ``1e-3`` learning rates), parsed in this process.

Bad input never shows a traceback: `unison train` answers with one line and a distinct exit code.

Every case drives ``unison.cli.main([...])`` in this process and asserts the exit code, a fragment
of the message and that stderr holds no traceback. Most cases fail in the parent (argument
parsing, `validate()`, the pre-flight of `cmd_train`) before any worker starts; a few are found
by a worker (in-process at world size 1, or in real worker processes) and must still reach the
user as one line. docs/reliability.md lists every case with its exact message; set
``UNISON_BAD_INPUT_LOG=FILE`` to append each case's exit code and message to FILE as JSON lines
(that is how the table is refreshed).

Exit codes: 1 worker failed, 2 configuration or usage, 3 data, 4 checkpoint, 5 non-finite loss."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from fault_helpers import run_cli

from unison.cli import main
from unison.training.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("run_env")   # tests/conftest.py: no image cache, no fault, not a restart


def test_integral_numbers_in_scientific_notation_are_integers():
    """``--epochs 1e9`` (run by steps) and ``epochs: 1e9`` in YAML are the integer 10**9; 1e-3 is a float."""
    from unison.cli.train_args import parse_train_args

    assert parse_train_args(["--epochs", "1e9", "--max-steps", "5"]).epochs == 10**9
    assert parse_train_args(["--epochs", "1_000"]).epochs == 1000
    cfg = parse_train_args(["--param", "temperature=1e-1", "--lr", "1e-3"])
    assert cfg.method_params == {"temperature": 0.1} and cfg.lr == 0.001


# -- with real processes --

TINY = ["--no-progress", "--batch-size", "64", "--subset", "256", "--val-subset", "64", "--knn-k", "5"]


W1 = ["--world-size", "1", "--max-steps", "2", *TINY]


# ------------------------------------------------------------------ fixtures
def _png(path: Path, value: int) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (value, 255 - value, value // 2)).save(path)


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


class _Evil:
    """Unpickling this runs os.mkdir(path): a stand-in for arbitrary code in a checkpoint."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """Bad files and folders, plus one real checkpointed run ({run}) made by a 2-step training at W=1."""
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "file.txt").write_text("not a folder\n")
    _png(tmp / "listed" / "a.png", 30)                                  # a file list naming a missing file
    (tmp / "list.txt").write_text(f"{tmp / 'listed' / 'a.png'}\n{tmp / 'gone.png'}\n")
    (tmp / "shards").mkdir()                                            # shards: one without any image
    _tar(tmp / "shards" / "a.tar", [("k/1.png", (tmp / "listed" / "a.png").read_bytes())])
    _tar(tmp / "shards" / "b.tar", [("k/2.cls", b"0")])
    _tar(tmp / "full.tar", [(f"k/{i}.png", (tmp / "listed" / "a.png").read_bytes()) for i in range(3)])
    (tmp / "cut.tar").write_bytes((tmp / "full.tar").read_bytes()[:700])   # a truncated tar
    (tmp / "empty").mkdir()
    _png(tmp / "flat" / "a.png", 10)                                   # images but no class folders
    (tmp / "noimages" / "cat").mkdir(parents=True)
    (tmp / "noimages" / "cat" / "readme.txt").write_text("no images here\n")
    for c in range(2):                                                  # 8 good images: fewer than a batch
        for i in range(4):
            _png(tmp / "small" / f"class{c}" / f"{i}.png", 40 * i + c)
    for c in range(2):                                                  # every file is garbage
        for i in range(4):
            (tmp / "garbage" / f"class{c}").mkdir(parents=True, exist_ok=True)
            (tmp / "garbage" / f"class{c}" / f"{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    for c in range(2):                                                  # 32 good images and one corrupt one
        for i in range(16):
            _png(tmp / "onebad" / f"class{c}" / f"{i:02d}.png", 15 * i + c)
    (tmp / "onebad" / "class1" / "zz_bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")

    y = tmp / "yaml"
    y.mkdir()
    (y / "invalid.yaml").write_text("epochs: [1, 2\n")
    (y / "python_tag.yaml").write_text(f"epochs: !!python/object/apply:os.mkdir ['{tmp / 'pwned_by_yaml'}']\n")
    (y / "unknown_key.yaml").write_text("epoch: 3\n")
    (y / "list.yaml").write_text("- epochs\n- 3\n")
    (y / "unknown_distributed.yaml").write_text("distributed:\n  world_sise: 2\n")
    (y / "wrong_type.yaml").write_text("epochs: ten\n")
    (y / "distributed_scalar.yaml").write_text("distributed: 5\n")
    (y / "nested_wrong_type.yaml").write_text("distributed:\n  timeout_s: soon\n")
    (y / "float_for_int.yaml").write_text("subset: 1.5\n")
    (y / "world_size_at_top.yaml").write_text("world_size: 4\n")
    (y / "epochs_under_distributed.yaml").write_text("distributed:\n  epochs: 3\n")

    run = tmp / "run"
    assert main(["train", *W1, "--checkpoint-every", "1", "--out", str(run)]) == 0
    good = run / "checkpoints" / "step_00000002.pt"
    c = tmp / "ckpt"
    c.mkdir()
    data = good.read_bytes()
    (c / "truncated.pt").write_bytes(data[: len(data) // 2])
    (c / "empty.pt").write_bytes(b"")
    torch.save({"weight": torch.zeros(3, 3), "bias": torch.zeros(3)}, c / "foreign.pt")
    future = torch.load(good, weights_only=True)
    future["version"] = 99
    torch.save(future, c / "future.pt")
    torch.save({"format": "unison-checkpoint", "version": 1, "method": "simclr", "step": 1, "config": {},
                "model": _Evil(tmp / "pwned_by_checkpoint")}, c / "malicious.pt")
    (c / "no_checkpoints").mkdir()
    return {"tmp": str(tmp), "run": str(run), "y": str(y), "c": str(c)}




def _run(argv: list[str], capfd) -> tuple[int, str]:
    return run_cli(["train", *argv], capfd)


def _log(case_id: str, code: int, err: str, paths: dict[str, str]) -> str:
    """The user-facing error line; appended to $UNISON_BAD_INPUT_LOG for docs/reliability.md."""
    errors = [line for line in err.splitlines() if line.startswith(("unison: error:", "unison train: error:"))]
    assert len(errors) == 1, err
    line = errors[0]
    if os.environ.get("UNISON_BAD_INPUT_LOG"):
        shown = line.replace(paths["tmp"], "<tmp>")
        with open(os.environ["UNISON_BAD_INPUT_LOG"], "a") as f:
            f.write(json.dumps({"id": case_id, "code": code, "message": shown}) + "\n")
    return line


# ------------------------------------------------------------------ the table
# (id, argv, exit code, message fragment); {tmp}, {run}, {y} (YAML files), {c} (checkpoints) are filled in.
CASES = [
    # --- command-line flags and configuration values (ConfigError, exit 2, before any worker)
    ("unknown-method", ["--method", "mocov9"], 2, "method='mocov9' is unknown (did you mean 'mocov3'?); use one of"),
    ("batch-not-divisible-by-workers", ["--batch-size", "255"], 2,
     "batch_size=255 (global) cannot be split evenly over world_size=2; use a multiple of 2"),
    ("batch-not-divisible-by-3-workers", ["--world-size", "3", "--batch-size", "64"], 2,
     "cannot be split evenly over world_size=3; use a multiple of 3, e.g. 63"),
    ("zero-epochs", ["--epochs", "0"], 2, "epochs=0 must be an integer >= 1"),
    ("negative-lr", ["--lr", "-1"], 2, "lr=-1.0 must be a finite number >= 0"),
    ("nan-lr", ["--lr", "nan"], 2, "lr=nan must be a finite number >= 0"),
    ("zero-lr", ["--lr", "0"], 2, "lr=0 would not train"),
    ("zero-workers", ["--world-size", "0"], 2, "distributed.world_size=0 must be an integer >= 1"),
    ("nccl-without-cuda", ["--backend", "nccl"], 2, "needs CUDA GPUs and none is available; use --backend gloo"),
    ("local-backend-with-2-workers", ["--backend", "local"], 2, "use --world-size 1 or --backend gloo"),
    ("backend-mpi-without-mpirun", ["--backend", "mpi"], 2,
     "--backend mpi is for workers started by mpirun (or srun) and no launcher started this one"),
    ("bf16-compression-on-gloo", ["--grad-compression", "bf16"], 2, "needs CUDA + NCCL"),
    ("powersgd-start-iter-1", ["--grad-compression", "powersgd", "--powersgd-start-iter", "1"], 2,
     "powersgd_start_iter=1 must be an integer >= 2"),
    ("port-out-of-range", ["--master-port", "70000"], 2, "master_port=70000 must be an integer in [0, 65535]"),
    ("empty-master-addr", ["--master-addr", ""], 2, "master_addr is empty"),
    ("zero-timeout", ["--timeout-s", "0"], 2, "timeout_s=0.0 must be a finite number >= 1"),
    ("infinite-timeout", ["--timeout-s", "inf"], 2, "timeout_s=inf must be a finite number >= 1"),
    ("negative-watchdog", ["--watchdog-s", "-1"], 2,
     "distributed.watchdog_s=-1.0 must be a finite number >= 0 and <= 2147483.648 seconds (0 = no watchdog)"),
    ("unknown-method-param", ["--param", "temprature=0.1"], 2,
     "unknown simclr parameter(s) 'temprature' (did you mean 'temperature'?)"),
    ("param-without-value", ["--param", "temperature"], 2, "must look like NAME=VALUE"),
    ("param-wrong-type", ["--param", "temperature=warm"], 2, "--param temperature='warm' must be a float"),
    # --- issue 17: inputs that ended in a traceback or a cryptic message (all refused before any worker starts)
    ("param-unclosed-bracket", ["--param", "temperature=[0.1"], 2,
     "--param temperature='[0.1' is not a value (line 1, column 5: expected ',' or ']'"),
    ("param-python-tag", ["--param", "x=!!python/object/apply:os.mkdir ['{tmp}/pwned_by_param']"], 2,
     "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.mkdir'"),
    ("param-negative-size", ["--param", "proj_dim=-5"], 2,
     "SimCLR parameter proj_dim=-5 must be an integer >= 1 (--param proj_dim=VALUE)"),
    ("param-zero-size", ["--param", "proj_dim=0"], 2, "SimCLR parameter proj_dim=0 must be an integer >= 1"),
    ("param-zero-dino-out-dim", ["--method", "dino", "--param", "out_dim=0"], 2,
     "DINO parameter out_dim=0 must be an integer >= 2"),
    ("param-zero-temperature", ["--param", "temperature=0"], 2,
     "SimCLR parameter temperature=0 must be a finite number >= 0.0001"),
    ("param-momentum-above-1", ["--method", "byol", "--param", "momentum_base=1.5"], 2,
     "BYOL parameter momentum_base=1.5 must be a number in [0, 1]"),
    ("timeout-past-torch", ["--timeout-s", "1e15"], 2,
     "distributed.timeout_s=1e+15 is past the longest timeout torch takes safely, 2147483 s"),
    ("warmup-past-any-run", ["--warmup-epochs", "1e308"], 2, "warmup_epochs=1e+308 is past 1e9 epochs"),
    ("seed-past-64-bits", ["--seed", "18446744073709551616"], 2,
     "seed=18446744073709551616 must be an integer in [0, 2**64-1]"),
    ("epochs-past-1e9", ["--epochs", "1e12"], 2, "epochs=1000000000000 is past 1e9; to run by steps, give --max-steps"),
    ("epochs-not-integral", ["--epochs", "1.5"], 2, "argument --epochs: invalid int value: '1.5'"),
    ("backbone-arg-for-a-cnn", ["--backbone-arg", "drop_path_rate=0.1"], 2,
     "--backbone-arg drop_path_rate is for timm backbones (--backbone timm:<name>); small_cnn takes none"),
    ("zero-knn-k", ["--knn-k", "0"], 2, "knn_k=0 must be an integer >= 1"),
    ("zero-knn-t", ["--knn-t", "0"], 2, "knn_t=0.0 must be a finite number >= 0.02"),
    ("zero-grad-sync-every", ["--grad-sync-every", "0"], 2, "grad_sync_every=0 must be an integer >= 1"),
    ("unknown-shard", ["--shard", "zero3"], 2, "argument --shard: invalid choice: 'zero3'"),
    ("full-shard-with-compression", ["--shard", "full", "--grad-compression", "fp16"], 2,
     "grad_compression='fp16' is a DDP communication hook, which --shard full (FSDP) does not have"),
    ("full-shard-with-fp16", ["--shard", "full", "--amp", "fp16"], 2, "use --amp bf16"),
    ("zero-subset", ["--subset", "0"], 2, "subset=0 must be an integer >= 1"),
    ("zero-max-steps", ["--max-steps", "0"], 2, "max_steps=0 must be an integer >= 1"),
    ("zero-keep-checkpoints", ["--keep-checkpoints", "0"], 2, "keep_checkpoints=0 must be an integer >= 1"),
    ("negative-warmup", ["--warmup-epochs", "-1"], 2, "warmup_epochs=-1.0 must be a finite number >= 0"),
    ("negative-checkpoint-every", ["--checkpoint-every", "-1"], 2, "checkpoint_every=-1 must be an integer >= 0"),
    ("unknown-optimizer", ["--optimizer", "rmsprop"], 2, "optimizer='rmsprop' is unknown"),
    ("unknown-backbone", ["--backbone", "resnet999"], 2, "backbone='resnet999' is unknown"),
    ("decode-gpu-without-cuda", ["--decode", "gpu"], 2, "--decode gpu decodes JPEGs on the GPU and this machine has no "
                                                        "CUDA device; use --decode cpu"),
    ("stream-the-digits", [*W1, "--data-mode", "stream", "--out", "{tmp}/o4"], 2, "--data digits is built in and "
                                                                                  "always held in memory"),
    ("unknown-augmentation", ["--augmentation", "sepia"], 2, "augmentation='sepia' is unknown"),
    ("run-dir-is-a-file", ["--out", "{tmp}/file.txt/run"], 2, "cannot create the run directory"),
    # --- argparse (exit 2: usage line + one error line)
    ("flag-not-an-integer", ["--epochs", "ten"], 2, "argument --epochs: invalid int value: 'ten'"),
    ("flag-invalid-choice", ["--precision", "float16"], 2, "argument --precision: invalid choice: 'float16'"),
    ("unknown-flag", ["--epochz", "3"], 2, "unrecognized arguments: --epochz 3"),
    # --- YAML configuration files (exit 2)
    ("yaml-missing", ["--config", "{y}/nope.yaml"], 2, "nope.yaml does not exist"),
    ("yaml-invalid-syntax", ["--config", "{y}/invalid.yaml"], 2,
     "invalid.yaml is not valid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>'"),
    ("yaml-python-tag", ["--config", "{y}/python_tag.yaml"], 2,
     "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.mkdir'"),
    ("yaml-unknown-key", ["--config", "{y}/unknown_key.yaml"], 2,
     "unknown_key.yaml: line 1: epoch is not an option (did you mean 'epochs'?)"),
    ("yaml-distributed-key-at-top", ["--config", "{y}/world_size_at_top.yaml"], 2,
     "world_size belongs under 'distributed:' in a config file (distributed: {world_size: 4})"),
    ("yaml-top-key-under-distributed", ["--config", "{y}/epochs_under_distributed.yaml"], 2,
     "distributed.epochs: epochs belongs at the top level of a config file, not under 'distributed:'"),
    ("yaml-not-a-mapping", ["--config", "{y}/list.yaml"], 2, "must hold a mapping of option names to values"),
    ("yaml-unknown-distributed-key", ["--config", "{y}/unknown_distributed.yaml"], 2,
     "distributed.world_sise is not a distributed option (did you mean 'world_size'?)"),
    ("yaml-wrong-type", ["--config", "{y}/wrong_type.yaml"], 2, "wrong_type.yaml: line 1: epochs='ten' must be an int"),
    ("yaml-float-for-int", ["--config", "{y}/float_for_int.yaml"], 2, "float_for_int.yaml: line 1: subset=1.5 must be an int"),
    ("yaml-distributed-not-a-mapping", ["--config", "{y}/distributed_scalar.yaml"], 2,
     "distributed must be a mapping of distributed options, got 5"),
    ("yaml-nested-wrong-type", ["--config", "{y}/nested_wrong_type.yaml"], 2,
     "distributed.timeout_s='soon' must be a float"),
    # --- data folders (DataError, exit 3; the pre-flight finds them before any worker starts)
    ("data-folder-missing", ["--data", "{tmp}/nope"], 3, "nope does not exist (expected an ImageFolder layout"),
    ("data-is-a-file", ["--data", "{tmp}/file.txt"], 3, "file.txt: line 1:"),
    ("data-list-missing-file", ["--data", "{tmp}/list.txt"], 3, "list.txt: line 2:"),
    ("data-empty-shard", ["--data", "{tmp}/shards"], 3, "shards/b.tar holds no image samples"),
    ("data-truncated-shard", ["--data", "{tmp}/cut.tar"], 3, "cut.tar is truncated"),
    ("data-folder-empty", ["--data", "{tmp}/empty"], 3, "empty is empty"),
    ("data-flat-folder-fewer-than-a-batch", ["--data", "{tmp}/flat"], 3,
     "flat has 1 images, fewer than one global batch (256)"),
    ("data-no-image-files", ["--data", "{tmp}/noimages"], 3, "no image files (.jpg, .jpeg, .png, ...) in the class"),
    ("val-folder-missing", ["--val", "{tmp}/nope"], 3, "nope does not exist"),
    ("data-fewer-images-than-a-batch", ["--data", "{tmp}/small", "--batch-size", "64"], 3,
     "has 8 images, fewer than one global batch (64); lower --batch-size"),
    ("data-subset-larger-than-folder", ["--data", "{tmp}/small", "--subset", "100"], 3,
     "has 8 images, fewer than --subset/--val-subset 100"),
    # ... found while loading, in the (in-process) worker
    ("digits-subset-larger-than-data", [*W1, "--subset", "100000", "--out", "{tmp}/o1"], 3,
     "subset=100000 is larger than the dataset"),
    ("digits-fewer-images-than-a-batch", [*W1, "--batch-size", "4096", "--out", "{tmp}/o2"], 3,
     "fewer than one global batch (4096); lower --batch-size"),
    ("every-image-corrupt", [*W1, "--data", "{tmp}/garbage", "--subset", "8", "--val", "{tmp}/small",
                             "--val-subset", "8", "--batch-size", "8", "--out", "{tmp}/o3"], 3,
     "no readable images in"),
    # ... method and backbone that do not fit (found when the worker builds the method / draws the first masks)
    ("token-method-without-vit", [*W1, "--method", "mae", "--backbone", "small_cnn", "--out", "{tmp}/o8"], 2,
     "MAE needs a ViT backbone with patch tokens"),
    ("ijepa-blocks-cover-the-image", [*W1, "--method", "ijepa", "--backbone", "vit_nano_p4", "--out", "{tmp}/o9"], 2,
     "no context is left; use a backbone with smaller patches"),
    # --- checkpoints to resume (CheckpointError, exit 4)
    ("resume-path-missing", ["--resume", "{tmp}/nope"], 4, "nope does not exist; pass a checkpoint file or a run"),
    ("resume-dir-without-checkpoints", ["--resume", "{c}/no_checkpoints"], 4, "a unison train run that wrote checkpoints"),
    ("resume-truncated-file", ["--resume", "{c}/truncated.pt"], 4, "truncated.pt is truncated or corrupt"),
    ("resume-empty-file", ["--resume", "{c}/empty.pt"], 4, "empty.pt is empty (0 bytes)"),
    ("resume-foreign-file", ["--resume", "{c}/foreign.pt"], 4,
     "foreign.pt is not a unison checkpoint (it holds a dict with keys weight, bias"),
    ("resume-newer-format", ["--resume", "{c}/future.pt"], 4, "has format version 99, this unison reads up to 1"),
    ("resume-code-in-pickle", ["--resume", "{c}/malicious.pt"], 4,
     "holds Python objects that could run code when unpickled"),
    ("resume-other-method", ["--resume", "{run}", "--method", "byol", "--out", "{tmp}/o4"], 4,
     "was written by method 'simclr', this run is 'byol'"),
    ("resume-other-backbone", ["--resume", "{run}", "--backbone", "resnet18", "--out", "{tmp}/o7"], 4,
     "was trained with --backbone small_cnn, this run has --backbone resnet18; use --backbone small_cnn to resume it"),
    ("resume-other-shape", ["--resume", "{run}", "--param", "proj_dim=64", "--out", "{tmp}/o5"], 4,
     "checkpoint does not match the model: parameter projector"),
    ("resume-at-indivisible-world-size", ["--resume", "{run}", "--world-size", "3", "--out", "{tmp}/o6"], 2,
     "cannot be split evenly over world_size=3"),
    # --- training and environment
    ("diverging-lr", [*W1, "--lr", "1e30", "--max-steps", "4", "--checkpoint-every", "1", "--out", "{tmp}/o7"], 5,
     "non-finite loss (nan) at step 1 on rank 0; lower --lr, set --grad-clip, or check the data"),
]


ENV_CASES = [
    ("launcher-rank-not-an-integer", {"RANK": "x", "WORLD_SIZE": "2"}, [*W1, "--out", "{tmp}/o8"], 2,
     "environment variable RANK='x' is not an integer"),
    # --- issue 17: partial launcher variables (refused before start) and fewer processes than declared
    ("mpi-rank-without-size", {"OMPI_COMM_WORLD_RANK": "0"}, [*TINY, "--out", "{tmp}/o11"], 2,
     "environment variable OMPI_COMM_WORLD_RANK='0' is set but OMPI_COMM_WORLD_SIZE is not; mpirun sets both"),
    ("pmi-rank-without-size", {"PMI_RANK": "0"}, [*TINY, "--out", "{tmp}/o12"], 2,
     "environment variable PMI_RANK='0' is set but PMI_SIZE is not"),
    ("torchrun-rank-without-world-size", {"RANK": "0"}, [*TINY, "--out", "{tmp}/o13"], 2,
     "environment variable RANK='0' is set but WORLD_SIZE is not"),
    ("mpi-size-2-one-process", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_PORT": "{port}"},
     [*TINY, "--max-steps", "1", "--timeout-s", "2", "--out", "{tmp}/o14"], 1,
     "only 1 of 2 processes joined the rendezvous at 127.0.0.1:{port} within 2 s; start all 2 processes"),
    ("slurm-ntasks-2-one-process", {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
                                    "MASTER_PORT": "{port}"},
     [*TINY, "--max-steps", "1", "--timeout-s", "2", "--out", "{tmp}/o15"], 1,
     "only 1 of 2 processes joined the rendezvous at 127.0.0.1:{port} within 2 s"),
    ("world-size-disagrees-with-launcher", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                                            "MASTER_PORT": "{port}"}, [*TINY, "--world-size", "4"], 2,
     "--world-size 4 but mpirun started 2 worker processes; the launcher decides the world size"),
    # --- issue 28: mpirun's rendezvous (port from the job id; loopback only on one node), --backend mpi's launcher
    ("backend-mpi-under-torchrun", {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "{port}"},
     [*W1, "--backend", "mpi", "--out", "{tmp}/o16"], 2, "--backend mpi is for workers started by mpirun (or srun) "
     "and torchrun started this one"),
    ("mpirun-on-two-nodes-without-master-addr", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                                                 "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_MCA_ess_base_jobid": "7"},
     [*TINY, "--out", "{tmp}/o17"], 2, "mpirun started the 2 ranks on several nodes, so the rendezvous cannot be on "
     "loopback (127.0.0.1); give every rank rank 0's host: mpirun -x MASTER_ADDR=<rank 0's host>"),
    ("mpirun-without-job-id-or-port", {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                                       "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, [*TINY, "--out", "{tmp}/o18"], 2,
     "no rendezvous port: this mpirun names no job"),
    ("fault-injection-malformed", {"UNISON_TRAIN_HOOKS": "fault_injection", "UNISON_FAULT_INJECT": "rank=one"},
     [*W1, "--out", "{tmp}/o9"], 2,
     "UNISON_FAULT_INJECT='rank=one' must look like"),
]


def _fill(argv: list[str], paths: dict[str, str]) -> list[str]:
    return [a.format(**paths) for a in argv]


@pytest.mark.parametrize("case_id, argv, code, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case_id, argv, code, fragment, paths, capfd):
    got, err = _run(_fill(argv, paths), capfd)
    line = _log(case_id, got, err, paths)
    assert got == code, err
    assert fragment in line, line


@pytest.mark.parametrize("case_id, env, argv, code, fragment", ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_bad_environment(case_id, env, argv, code, fragment, paths, capfd, monkeypatch):
    from unison.distributed.launch import find_free_port

    filled = {**paths, "port": str(find_free_port())}
    for k, v in env.items():
        monkeypatch.setenv(k, v.format(**filled))
    got, err = _run(_fill(argv, filled), capfd)
    line = _log(case_id, got, err, paths)
    assert got == code, err
    assert fragment.format(**filled) in line, line


def test_untrusted_files_never_run_code(paths, capfd):
    """The YAML python tag and the pickled os.mkdir above were refused, not executed."""
    for argv in (["--config", "{y}/python_tag.yaml"], ["--resume", "{c}/malicious.pt"],
                 ["--param", "x=!!python/object/apply:os.mkdir ['{tmp}/pwned_by_param']"]):
        assert _run(_fill(argv, paths), capfd)[0] in (2, 4)
    assert not (Path(paths["tmp"]) / "pwned_by_yaml").exists()
    assert not (Path(paths["tmp"]) / "pwned_by_checkpoint").exists()
    assert not (Path(paths["tmp"]) / "pwned_by_param").exists()


def test_diverged_run_keeps_its_last_checkpoint(paths, capfd):
    """After the non-finite loss of `diverging-lr`, the checkpoint written before it still loads."""
    out = Path(paths["tmp"]) / "o7"
    if not out.exists():
        assert _run(_fill(CASES[-1][1], paths), capfd)[0] == 5
    assert load_checkpoint(out, expect_method="simclr")["step"] == 1


def test_full_disk_is_one_line_and_keeps_the_last_checkpoint(paths, capfd, monkeypatch):
    real_save, saves = torch.save, []

    def save(obj, f, *args, **kwargs):  # the second checkpoint meets a full disk
        if isinstance(obj, dict) and obj.get("format") == "unison-checkpoint":
            saves.append(obj["step"])
            if len(saves) == 2:
                f.write(b"x" * 1000)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    out = Path(paths["tmp"]) / "full"
    code, err = _run([*W1, "--max-steps", "3", "--checkpoint-every", "1", "--out", str(out)], capfd)
    line = _log("disk-full-during-checkpoint", code, err, paths)
    assert code == 4
    assert line.startswith("unison: error: no space left on device: could not write checkpoint "), line
    assert line.endswith(f"step_00000002.pt; the last good checkpoint is {out / 'checkpoints' / 'step_00000001.pt'} "
                         "(intact); free space, then continue with --resume auto"), line
    monkeypatch.undo()
    assert load_checkpoint(out)["step"] == 1
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_corrupt_image_found_by_a_worker_names_the_rank(paths, capfd):
    """A decoding error inside a real worker process still reaches the user as one line naming the rank."""
    argv = [*TINY, "--data", "{tmp}/onebad", "--val", "{tmp}/small", "--subset", "33", "--val-subset", "8",
            "--batch-size", "8",
            "--on-corrupt", "error", "--max-steps", "1", "--out", "{tmp}/o10"]
    code, err = _run(_fill(argv, paths), capfd)
    line = _log("corrupt-image-in-worker", code, err, paths)
    assert code == 3
    assert "unison: error: worker rank 0 failed: DataError: cannot read image " in line
    assert "zz_bad.png" in line and "pass on_corrupt='skip'" in line
