"""unison bench: counted communication bytes against the gradient size, writers, presets and CLI wiring."""




def test_cli_dry_run_wires_the_gpu_preset(capsys):
    from unison.cli import main

    assert main(["bench", "all", "--preset", "gpu", "--dry-run", "--data", "cifar10", "--val", "cifar10"]) == 0
    out = capsys.readouterr().out
    train_lines = [ln for ln in out.splitlines() if ln.startswith("unison train")]
    assert len(train_lines) == 6 * 3 + 1 + 2          # table, Lightly comparison, scaling
    assert all("--backbone resnet18" in ln and "--batch-size 512" in ln and "--knn-k 200" in ln for ln in train_lines)
    assert sum("--world-size 4" in ln for ln in train_lines) == 6 * 2 + 1
    assert all("--backend nccl" in ln for ln in train_lines)
