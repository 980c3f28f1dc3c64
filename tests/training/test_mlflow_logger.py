"""``unison train --logger mlflow`` end to end, read back from the run's own MLflow store with MLflow's client.

A 2-step run on the embedded digits (one worker, in this process), then ``--resume`` of its directory to step 4:
one MLflow run holds the configuration as params, the loss at every logged step of both attempts, the plot and the
summary as artifacts, and the run id is the one ``<out>/mlflow/run.json`` keeps. The logger's own cases (a server
that does not answer, a run that ends early, changed options on resume): tests/training/test_mlflow_run.py.
"""

from __future__ import annotations

import json

import pytest

from unison.cli import main

pytest.importorskip("mlflow", reason="the mlflow extra (pip install '.[mlflow]') is not installed")

TINY = ["--world-size", "1", "--no-progress", "--batch-size", "32", "--subset", "128", "--val-subset", "32",
        "--knn-k", "5", "--signal-images", "16", "--log-every", "1", "--logger", "mlflow"]


def test_a_run_and_its_resume_log_into_one_mlflow_run(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from unison.training.mlflow_run import local_store

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--max-steps", "2", "--out", str(run)]) == 0
    first = json.loads((run / "mlflow" / "run.json").read_text())
    assert first["tracking_uri"] is None   # the run's own store
    assert main(["train", "--resume", str(run), "--max-steps", "4", "--no-progress", "--log-every", "1"]) == 0
    assert f"continuing run {first['run_id']}" in capsys.readouterr().err
    assert json.loads((run / "mlflow" / "run.json").read_text())["run_id"] == first["run_id"]

    client = MlflowClient(tracking_uri=local_store(run))
    mlflow_run = client.get_run(first["run_id"])
    assert mlflow_run.info.status == "FINISHED"
    assert len(client.search_runs([mlflow_run.info.experiment_id])) == 1
    params = mlflow_run.data.params
    config = json.loads((run / "config.json").read_text())
    assert params["method"] == config["method"] == "simclr" and params["batch_size"] == "32"
    assert params["distributed.world_size"] == "1" and params["logger"] == "mlflow"
    assert mlflow_run.data.tags["resumed_with.max_steps"] == "4"
    loss = client.get_metric_history(first["run_id"], "loss")
    assert {m.step for m in loss} == {1, 2, 3, 4}
    csv_rows = (run / "metrics.csv").read_text().splitlines()[1:]
    assert len([m for m in loss]) == len([r for r in csv_rows if r.split(",")[2]])   # every loss row of the csv
    assert client.get_metric_history(first["run_id"], "knn_top1")   # the final kNN
    artifacts = {a.path for a in client.list_artifacts(first["run_id"])}
    assert {"plot.png", "summary.json", "config.json"} <= artifacts
    summary = json.loads((run / "mlflow" / "artifacts" / first["run_id"] / "artifacts" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["run_id"] == config["resolved"]["run_id"]
