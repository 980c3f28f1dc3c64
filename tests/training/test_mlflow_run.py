"""``--logger mlflow`` (`unison.training.mlflow_run` through `MetricsLogger`), against a real local MLflow store.

Everything is read back with MLflow's own client from the SQLite store the logger makes in ``<run dir>/mlflow``:
the params, a metric's history, the artifacts and the run's status; then a second logger on the same run directory
(what a resumed run opens) continues the same MLflow run. MLflow's telemetry is off (no network here).
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from unison.errors import ConfigError

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra (pip install '.[mlflow]') is not installed")

from mlflow.tracking import MlflowClient  # noqa: E402

from unison.config.train import check_logger_packages  # noqa: E402
from unison.training.metrics import MetricsLogger  # noqa: E402
from unison.training.mlflow_run import MLFLOW_DIR, local_store  # noqa: E402

CONFIG = {"method": "simclr", "epochs": 2, "lr": None, "resume": None, "method_params": {"temperature": 0.5},
          "distributed": {"world_size": 1}, "backbone_args": {}}


@pytest.fixture(autouse=True)
def quiet_mlflow(monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)


def _train(run_dir, steps, config=CONFIG):
    """What a run does with its logger: rows per step, a kNN row, summary.json and config.json, then close."""
    logger = MetricsLogger(run_dir, kind="mlflow", config=config)
    for step in steps:
        logger.log(step=step, epoch=step / 4, loss=5.0 - step / 10, lr=0.1)
    logger.log(step=steps[-1], epoch=steps[-1] / 4, knn_top1=0.5)
    (run_dir / "summary.json").write_text(json.dumps({"steps": steps[-1]}))
    (run_dir / "config.json").write_text(json.dumps(config))
    logger.close()
    return json.loads((run_dir / MLFLOW_DIR / "run.json").read_text())["run_id"]


@pytest.fixture(scope="module")
def two_attempts(tmp_path_factory):
    """One run directory, trained for steps 1-4, then resumed from step 2 to step 6 with --epochs changed."""
    run_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        first = _train(run_dir, [1, 2, 3, 4])
        second = _train(run_dir, [3, 4, 5, 6], {**CONFIG, "epochs": 3, "resume": str(run_dir)})
    return run_dir, first, second


def test_params_metrics_and_artifacts_are_in_the_run_directorys_store(two_attempts):
    run_dir, run_id, _ = two_attempts
    client = MlflowClient(tracking_uri=local_store(run_dir))
    run = client.get_run(run_id)
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "unison"
    params = run.data.params
    assert params["method"] == "simclr" and params["lr"] == "null" and params["epochs"] == "2"
    assert params["method_params.temperature"] == "0.5" and params["distributed.world_size"] == "1"
    assert params["backbone_args"] == "{}"
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert loss[1] == pytest.approx(4.9) and loss[6] == pytest.approx(4.4)
    assert {m.step: m.value for m in client.get_metric_history(run_id, "knn_top1")} == {4: 0.5, 6: 0.5}
    assert {m.step: m.value for m in client.get_metric_history(run_id, "epoch")}[2] == 0.5
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"plot.png", "summary.json", "config.json"} <= artifacts
    assert (run_dir / MLFLOW_DIR / "artifacts").is_dir()   # the artifacts live in the run directory too


def test_a_resumed_run_continues_the_same_mlflow_run(two_attempts):
    run_dir, first, second = two_attempts
    assert second == first
    client = MlflowClient(tracking_uri=local_store(run_dir))
    assert len(client.search_runs([client.get_run(first).info.experiment_id])) == 1
    steps = [m.step for m in client.get_metric_history(first, "loss")]
    assert sorted(steps) == [1, 2, 3, 3, 4, 4, 5, 6]   # steps 3-4 trained again after the checkpoint at 2
    run = client.get_run(first)
    assert run.data.params["epochs"] == "2"                 # params never change in MLflow ...
    assert run.data.tags["resumed_with.epochs"] == "3"      # ... the resumed run's value is a tag
    assert run.data.tags["resumed_with.resume"] == str(run_dir) and run.data.params["resume"] == "null"
    assert run.info.status == "FINISHED"


def test_a_run_that_ends_early_is_killed_and_resumes_running(tmp_path):
    logger = MetricsLogger(tmp_path, kind="mlflow", config=CONFIG)
    logger.log(step=1, epoch=0.25, loss=4.0)
    logger.release()   # a run that failed or was preempted
    run_id = json.loads((tmp_path / MLFLOW_DIR / "run.json").read_text())["run_id"]
    client = MlflowClient(tracking_uri=local_store(tmp_path))
    assert client.get_run(run_id).info.status == "KILLED"
    again = MetricsLogger(tmp_path, kind="mlflow", config=CONFIG)
    assert client.get_run(run_id).info.status == "RUNNING"
    again.release()


def test_a_tracking_server_that_does_not_answer_is_one_line(tmp_path, monkeypatch):
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"tracking server MLFLOW_TRACKING_URI=http://127.0.0.1:{port} does not "
                                          "answer") as info:
        MetricsLogger(tmp_path, kind="mlflow", config=CONFIG)
    assert "\n" not in str(info.value)
    assert time.monotonic() - started < 120   # refused, not MLflow's minutes of retries (a generous bound)


def test_the_local_store_without_its_sql_packages_names_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "alembic" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs alembic: .* -m pip install .*mlflow-skinny.*alembic"):
        check_logger_packages("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")   # a server: the client alone is enough
    check_logger_packages("mlflow")
