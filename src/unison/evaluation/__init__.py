"""How good a trained encoder is, by the protocols papers and users score with: kNN, linear probes, fine-tuning.

The method is rebuilt from the checkpoint's stored configuration (`unison.training.load.load_method`), the
training and held-out data default to the run's own (same subsets, same seed, same image size and normalisation
statistics, as recorded in the checkpoint; `unison.evaluation.sets`). The protocols:

* **kNN** (weighted, k=200, t=0.1: Lightly's benchmark protocol; `unison.eval.knn`) and the **fast linear probe**
  (100 epochs of Adam on the frozen, un-augmented features: `unison.eval.linear`), on at most 5,000 reference
  images (class-balanced) and 2,000 held-out ones (or ``--val-subset N``), every image embedded **once**
  (`unison.evaluation.fast`): seconds on a CPU, the numbers the training loop reports. The default.
* ``--linear-protocol standard`` (or ``both``): the **standard linear evaluation** behind published numbers: a
  linear classifier on the frozen backbone, trained by SGD on augmented views of every labelled training
  image, top-1 and top-5 on every held-out image (`unison.eval.recipe`).
* ``--fine-tune``: **end-to-end fine-tuning** of the backbone with a new linear head (MAE's recipe for ViTs,
  SimCLR's for CNNs), top-1 and top-5 on every held-out image.

The last two train: on any world size (``--world-size N``, or the processes torchrun, srun or mpirun started),
exact (W workers of B/W images train like one of B), checkpointed in ``--out`` and resumable (``--resume``), bf16 on
a GPU, on data of any size (in memory or streamed), with progress and ``metrics.csv`` like ``unison train``
(`unison.evaluation.full`, `unison.eval.finetune`).

``--labels N|P%``: every protocol learns from a class-balanced subset of N labelled images (or P % of ``--data``),
drawn with ``--seed`` (`unison.eval.labels`); ``--from-scratch``: each protocol also from a randomly initialised
backbone (the run's architecture and seed), and the report says the difference: what pre-training bought.

The report (`unison.evaluation.report`): every score with its protocol and the labels used, printed, and written
to ``OUT/eval.json`` and ``OUT/eval.md`` (``--out``, default ``RUN_DIR/eval``); ``--json PATH`` writes the JSON
there too. A new evaluation into an ``--out`` that holds an earlier one first moves that one's files into
``OUT/earlier-runs/<time>/`` (``--resume`` continues it instead); an existing ``--json`` file is replaced only with
``--overwrite``; both are checked before anything is loaded (`unison.paths.check_output`).

A run of your own backbone (``unison.train(cfg, backbone=...)``) is rebuilt from its class when that imports and
builds without arguments (`unison.training.load.own_backbone`; else one line, and ``unison.evaluate(run,
backbone=YourNet(...))`` takes an instance); labelled dataset objects replace ``--data``/``--val`` for kNN and the
fast probe through ``unison.evaluate(run, dataset=..., val=...)``.

Example::

    unison eval --checkpoint runs/default                       # kNN + fast linear probe on the run's data
    unison eval --checkpoint runs/cifar --labels 10% --fine-tune --from-scratch --epochs 30
    unison eval --checkpoint runs/cifar --linear-protocol standard --world-size 4 --no-knn
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

from unison.config.fields import count
from unison.errors import ConfigError, DataError

from .options import DEVICES, LINEAR_PROTOCOLS, EvalOptions
from .report import as_json, is_markdown_report, markdown, rows, text_table

__all__ = ["DEVICES", "LINEAR_PROTOCOLS", "EvalOptions", "add_subcommand", "check_json_path", "cmd_eval",
           "evaluate_checkpoint", "is_eval_result", "out_dir"]


def evaluate_checkpoint(opts: EvalOptions, *, backbone: Any = None, dataset: Any = None,
                        val: Any = None) -> dict[str, Any]:
    """Run the protocols `opts` asks for; return the results (what ``eval.json`` holds) and write the report.
    `backbone`: an instance for a run of the user's own backbone class (`unison.training.load.own_backbone`);
    `dataset` and `val`: labelled reference and held-out dataset objects, in place of ``--data``/``--val``."""
    from unison.training.load import load_method
    from unison.training.summary import peak_memory_mib, steady_heap

    opts.validate()
    assert opts.checkpoint is not None   # validate() raised ConfigError otherwise
    outputs = check_outputs(opts)
    if opts.full_protocols:
        from .full import launched_world

        launched_world(opts)   # a --world-size other than the launcher's: one line before anything is loaded
    steady_heap()
    device = torch.device("cuda" if opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    t0 = time.perf_counter()
    method, cfg, ckpt = load_method(opts.checkpoint, device, backbone=backbone)
    result: dict[str, Any] = {
        "unison": "eval", "checkpoint": str(opts.checkpoint), "method": ckpt["method"], "backbone": cfg.backbone,
        "step": int(ckpt["step"]), "knn_top1": None, "linear_top1": None, "linear_train_top1": None,
        "load_time_s": time.perf_counter() - t0}
    choice = _fast_protocols(result, method, cfg, ckpt, opts, device, dataset, val)
    del method
    _full_protocols(result, opts, choice, device)
    result["report"] = rows(result, opts)
    result["peak_memory_mib"] = round(peak_memory_mib(device), 1)   # RSS on the CPU, the allocator's peak on CUDA
    result["options"] = dataclasses.asdict(opts)
    if launched_rank() == 0:   # under torchrun every process evaluates; one writes
        _write(outputs, result)
    return result


def _fast_protocols(result: dict[str, Any], method: Any, cfg: Any, ckpt: dict[str, Any], opts: EvalOptions,
                    device: torch.device, dataset: Any, val: Any) -> Any:
    """kNN and the fast probe (and from scratch) into `result`, with the data and the labels every protocol uses;
    returns the data chosen (None for dataset objects)."""
    from .fast import fast_scores, scratch_method
    from .sets import choose_data, eval_data, labels_drawn, object_data

    choice: Any = None
    ev: Any = None
    if dataset is not None or val is not None:
        ev, data_name, val_name = object_data(dataset, val, opts, cfg, ckpt, device)
    else:
        choice = choose_data(opts, cfg, ckpt)
        data_name, val_name = choice.data, choice.val
        ev = eval_data(choice, cfg, ckpt, device) if opts.knn or opts.fast_linear else None
    result.update(data=data_name, val=val_name, full=[])
    if ev is not None:
        t1 = time.perf_counter()
        result.update(fast_scores(method, ev, cfg, opts))
        if opts.from_scratch:
            scratch = scratch_method(str(opts.checkpoint), cfg, ckpt, device)
            result["scratch"] = fast_scores(scratch, ev, cfg, opts, " (from scratch)")
        result["fast_time_s"] = time.perf_counter() - t1
    result["labels"] = labels_drawn(choice, opts, int(result.get("train_images") or 0),
                                    ev.sets.reference_labels if ev is not None else None)
    return choice


def _full_protocols(result: dict[str, Any], opts: EvalOptions, choice: Any, device: torch.device) -> None:
    """Fine-tuning and the standard linear protocol (and from scratch), each in its workers."""
    import contextlib

    from .full import check_batch, launched_world, process_group, run_protocol

    if not opts.full_protocols:
        return
    if choice is not None:
        check_batch(opts, choice, launched_world(opts) or opts.world_size)
    # under torchrun, srun or mpirun this process is a worker: it joins their group once, for every protocol
    with process_group() if launched_world(opts) is not None else contextlib.nullcontext():
        for protocol in opts.full_protocols:
            for scratch in (False, True) if opts.from_scratch else (False,):
                started = time.perf_counter()
                r = run_protocol(opts, choice, protocol, scratch, out_dir(opts), device.type)
                r["time_s"] = round(time.perf_counter() - started, 2)
                result["full"].append(r)


def launched_rank() -> int:
    """This process's rank among the processes torchrun, srun or mpirun started (0 without a launcher)."""
    from unison.distributed.env import detect_launch_env

    launch_env = detect_launch_env()
    return launch_env.rank if launch_env is not None else 0


def out_dir(opts: EvalOptions) -> Path:
    """``--out``, else the run directory's ``eval`` folder (beside its checkpoints)."""
    if opts.out:
        return Path(opts.out)
    path = Path(str(opts.checkpoint))
    if path.is_dir() and not path.name.endswith(".dcp"):
        return path / "eval"
    folder = path.parent
    return (folder.parent if folder.name == "checkpoints" else folder) / "eval"


def check_outputs(opts: EvalOptions) -> dict[str, Path]:
    """The report's files (and ``--json``), checked before anything is loaded: ``--out`` is never an input nor
    inside one, it holds nothing but an earlier evaluation (whose files move aside, `set_aside_earlier`), and
    ``--json`` follows every command's rule (an existing file only with ``--overwrite``)."""
    from unison.paths import Input, check_output
    from unison.training.load import checkpoint_inputs

    inputs = checkpoint_inputs(opts.checkpoint) if opts.checkpoint else []
    inputs += [Input(f"--{name}", getattr(opts, name), tree=True) for name in ("data", "val") if getattr(opts, name)]
    out = out_dir(opts)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for the report and the evaluations' checkpoints")
    found = {name.split(".")[1]: check_output(out / name, "--out", inputs=inputs, overwrite=True)
             for name in ("eval.json", "eval.md")}
    if opts.json:
        found["extra_json"] = check_json_path(opts)
    if launched_rank() == 0:
        set_aside_earlier(out, opts, inputs)
    return found


def set_aside_earlier(out: Path, opts: EvalOptions, inputs: list[Any]) -> None:
    """A new evaluation (not ``--resume``) into a folder that holds an earlier one moves its files into
    ``OUT/earlier-runs/<time>/`` (as ``unison train`` sets an earlier run aside) and says so in one line: a report
    never mixes two evaluations, and nothing is lost. A folder holding anything else is refused."""
    from unison.training.owner import EARLIER_RUNS, set_aside_earlier_run

    try:
        names = sorted(p.name for p in out.iterdir() if p.name != EARLIER_RUNS)
    except OSError:
        return
    if not names or opts.resume:
        return
    ours = {"eval.json", "eval.md", *(f"{p}{s}" for p in ("fine-tune", "linear-standard") for s in ("", "-scratch"))}
    if not set(names) <= ours or ("eval.json" in names and not is_eval_result(out / "eval.json")) or \
            ("eval.md" in names and not is_markdown_report(out / "eval.md")):
        raise ConfigError(f"--out {out} holds files that are not an earlier unison eval's ({', '.join(names[:4])}); "
                          "give an empty or new folder")
    moved = set_aside_earlier_run(out, inputs)
    if moved is not None:
        print(f"unison: {out} held an earlier evaluation: moved {', '.join(moved[1])} to {moved[0]}", file=sys.stderr)


def _write(outputs: dict[str, Path], result: dict[str, Any]) -> None:
    from unison.paths import write_text_atomic

    outputs["json"].parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(outputs["json"], as_json(result), "--out")
    write_text_atomic(outputs["md"], markdown(result), "--out")
    if "extra_json" in outputs:
        write_text_atomic(outputs["extra_json"], as_json(result), "--json")


def cmd_eval(ns: argparse.Namespace) -> int:
    from unison.config.fields import overrides_from_namespace

    opts = EvalOptions(**overrides_from_namespace(ns, EvalOptions))
    try:
        r = evaluate_checkpoint(opts)
    except DataError as e:   # a refused checkpoint stays a CheckpointError (exit 4)
        raise ConfigError(str(e)) from None
    if launched_rank() == 0:   # under torchrun every process evaluates; one prints
        for line in summary_lines(r, opts):
            print(line)
    return 0


def summary_lines(r: dict[str, Any], opts: EvalOptions) -> list[str]:
    """What ``unison eval`` prints: what was evaluated on what, a line per protocol, the report's table."""
    labels = r["labels"]
    lines = [f"unison eval: {r['method']} / {r['backbone']} at step {r['step']} ({opts.checkpoint}); data {r['data']}, "
             f"held out {r['val']}; labels {labels['labels']} ({labels['images']:,} of {labels['of']:,} images)"]
    if r["knn_top1"] is not None or r["linear_top1"] is not None:
        lines.append(f"  {r['train_images']} reference and {r['val_images']} held-out images, features in "
                     f"{r['feature_time_s']:.1f} s")
    if r["knn_top1"] is not None:
        lines.append(f"  kNN top-1     {r['knn_top1']:.4f}   (k={opts.knn_k}, t={opts.knn_t})")
    if r["linear_top1"] is not None:
        lines.append(f"  linear top-1  {r['linear_top1']:.4f}   (the fast probe: {count(opts.linear_epochs, 'epoch')} "
                     f"of {opts.linear_optimizer} on frozen un-augmented {opts.linear_norm} features of the "
                     f"{r['train_images']:,} reference images; train top-1 {r['linear_train_top1']:.4f}, "
                     f"{r['linear_time_s']:.1f} s; published numbers: --linear-protocol standard)")
    for full in r["full"]:
        top5 = f", top-5 {full['top5']:.4f}" if full["top5"] is not None else ""
        lines.append(f"  {full['protocol']}{' from scratch' if full['scratch'] else ''} top-1 {full['top1']:.4f}{top5}"
                     f"   ({count(full['steps'], 'step')} on {count(full['world_size'], 'worker')}, "
                     f"{full['time_s']:.0f} s; {full['folder']})")
    lines += text_table(r)
    lines.append(f"  wrote {out_dir(opts) / 'eval.json'} and eval.md" + (f", and {opts.json}" if opts.json else ""))
    return lines


def is_eval_result(path: Path) -> bool:
    """`path` holds an earlier ``unison eval`` result (how a refusal names it; what ``--out`` may set aside)."""
    import json

    try:
        if path.stat().st_size > 1 << 22:
            return False
        r = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(r, dict) and (r.get("unison") == "eval" or {"checkpoint", "knn_top1", "linear_top1"} <= set(r))


def check_json_path(opts: EvalOptions) -> Path:
    """``--json``, refused (one line) where it is an input, a directory, or an existing file without --overwrite."""
    from unison.paths import Input, check_output
    from unison.training.load import checkpoint_inputs

    assert opts.json is not None
    inputs = checkpoint_inputs(opts.checkpoint) if opts.checkpoint else []
    inputs += [Input(f"--{name}", getattr(opts, name)) for name in ("data", "val") if getattr(opts, name)]
    return check_output(opts.json, "--json", inputs=inputs, overwrite=opts.overwrite, own=is_eval_result,
                        own_text="an earlier unison eval result")


def add_subcommand(sub: argparse._SubParsersAction, help_text: str) -> None:
    from unison.config.fields import add_options_command

    add_options_command(sub, "eval", help_text,
                        __doc__.splitlines()[0], EvalOptions, cmd_eval)
