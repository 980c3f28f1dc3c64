"""``--logger mlflow``: a run's metrics, configuration and end files in MLflow tracking (rank 0).

Where: the tracking server or store ``MLFLOW_TRACKING_URI`` names (``http://host:5000``, ``sqlite:///mlflow.db``,
``databricks``), else a SQLite store of this run's own in ``<run dir>/mlflow/`` (``mlflow.db`` and
``artifacts/``; ``mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow/mlflow.db`` shows it). SQLite, not
MLflow's ``./mlruns`` folder store: since MLflow 3 that store is in maintenance mode and refuses to open unless
``MLFLOW_ALLOW_FILE_STORE`` is set. The experiment is ``$MLFLOW_EXPERIMENT_NAME``, else ``unison``; the run is
named after the run directory.

What: the run's configuration as params (nested options flattened: ``distributed.world_size``,
``method_params.temperature``); every row `MetricsLogger.log` writes to ``metrics.csv`` as metrics at its step
(``epoch`` among them); at the end ``plot.png``, ``summary.json`` and ``config.json`` as artifacts, and the run
marked FINISHED (KILLED when the run ended early: failed, preempted or interrupted).

Resume: ``<run dir>/mlflow/run.json`` keeps the MLflow run's id and where it is, so a resumed or restarted run of
the same directory logs into the same MLflow run (a fresh run into that directory moves the file aside with the
rest, `unison.training.owner`, and starts a new one). MLflow params never change: options a resumed run changed
(``--epochs 60``) keep their first value as params and get tags ``resumed_with.<option>`` with the new one. The steps
after the checkpoint are logged again, as in ``metrics.csv``: a step can have two values, the later one counts.

Failures: a tracking server that does not answer is one line before the first step (a probe with a short timeout:
MLflow's own client retries for minutes); a metric write that fails later is a warning at the end, and the run goes
on (``metrics.csv`` has every row). Writes are asynchronous (MLflow's own queue), at most one batch in flight, so
a slow server costs the step loop at most one round trip per logging interval.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from unison.errors import ConfigError
from unison.paths import write_text_atomic

MLFLOW_DIR = "mlflow"          # <run dir>/mlflow: run.json, and the local store when no server is named
RECORD = "run.json"
DEFAULT_EXPERIMENT = "unison"
PARAM_VALUE_LIMIT = 6000       # MLflow's longest param value, in characters
PARAMS_PER_BATCH = 100         # MLflow's most params (and tags) in one log_batch request
PROBE_TIMEOUT_S = 10.0         # a named server that has not answered by then is refused
END_FILES = ("plot.png", "summary.json", "config.json")


def local_store(run_dir: Path) -> str:
    """The tracking URI of the run's own SQLite store."""
    return "sqlite:///" + str((run_dir / MLFLOW_DIR / "mlflow.db").resolve())


def flat_params(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """`config` as MLflow params: nested mappings flattened with dots, values as text (JSON for non-strings)."""
    for key, value in config.items():
        if isinstance(value, dict) and value:
            yield from flat_params(value, f"{prefix}{key}.")
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        yield f"{prefix}{key}", text if len(text) <= PARAM_VALUE_LIMIT else text[: PARAM_VALUE_LIMIT - 3] + "..."


def probe(uri: str) -> None:
    """`ConfigError` unless the HTTP(S) tracking server `uri` answers within `PROBE_TIMEOUT_S` (any HTTP status
    counts: it is there); other URIs are the client's to open."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise ConfigError(f"--logger mlflow: the tracking server MLFLOW_TRACKING_URI={uri} does not answer "
                          f"({reason}); start it, correct MLFLOW_TRACKING_URI, or unset it to log into the run's "
                          f"own store (<out>/{MLFLOW_DIR})") from None


def _say(line: str) -> None:
    print(f"unison: MLflow: {line}", file=sys.stderr, flush=True)


class MLflowRun:
    """One MLflow run for a unison run directory: opened (or continued) at construction, `log` per row, `close` at
    the end, `release` for a run that ended early. `error(path, oserror)`: what a failed write of ``run.json``
    raises."""

    def __init__(self, run_dir: Path, config: dict[str, Any],
                 error: Callable[[Path, OSError], Exception] | None = None):
        self.run_dir, self.error = run_dir, error
        self.record = run_dir / MLFLOW_DIR / RECORD
        self.failures: list[str] = []
        self.pending: Any = None   # the batch in flight (mlflow's RunOperations)
        self.done = False
        earlier = self._read_record()
        named = os.environ.get("MLFLOW_TRACKING_URI") or None
        remote = named or earlier.get("tracking_uri")
        self.uri = remote or local_store(run_dir)
        probe(self.uri)
        same_store = earlier.get("tracking_uri") == remote
        if earlier and not same_store:
            _say(f"this run directory's MLflow run {earlier.get('run_id')} is in "
                 f"{earlier.get('tracking_uri') or 'its own store'}; MLFLOW_TRACKING_URI={named} names another: "
                 "a new MLflow run there")
        try:
            self._open(earlier.get("run_id") if same_store else None, remote, config)
        except ConfigError:
            raise
        except Exception as e:   # MLflow, its HTTP client and its SQL store raise many kinds; each is this one line
            raise ConfigError(f"--logger mlflow could not open a run in {self.uri}: {_first_line(e)}") from None

    def _read_record(self) -> dict[str, Any]:
        try:
            data = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) and isinstance(data.get("run_id"), str) else {}

    def _open(self, run_id: str | None, remote: str | None, config: dict[str, Any]) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        for name in ("mlflow.store.db.utils", "alembic"):   # the store's creation: INFO lines of no use to a user
            logging.getLogger(name).setLevel(logging.WARNING)
        self.client = client = MlflowClient(tracking_uri=self.uri)
        if run_id is not None:
            try:
                client.get_run(run_id)
            except MlflowException:
                _say(f"run {run_id} of this run directory is not in {self.uri} any more: a new MLflow run")
                run_id = None
        if run_id is None:
            run = client.create_run(self._experiment(remote is None), run_name=self.run_dir.name,
                                    tags={"unison.run_dir": str(self.run_dir.resolve())})
            run_id = run.info.run_id
            _say(f"run {run_id} in {self.uri}" + ("" if remote else f" (mlflow ui --backend-store-uri {self.uri})"))
        else:
            client.update_run(run_id, status="RUNNING")
            _say(f"continuing run {run_id} in {self.uri}")
        self.run_id = run_id
        write_text_atomic(self.record, json.dumps({"run_id": run_id, "tracking_uri": remote}, indent=2) + "\n",
                          error=self.error)
        logged = client.get_run(run_id).data.params
        params = dict(flat_params(config))
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        changed = [RunTag(f"resumed_with.{k}", v) for k, v in params.items() if k in logged and logged[k] != v]
        for i in range(0, max(len(new), len(changed)), PARAMS_PER_BATCH):
            client.log_batch(run_id, params=new[i:i + PARAMS_PER_BATCH], tags=changed[i:i + PARAMS_PER_BATCH])

    def _experiment(self, local: bool) -> str:
        from mlflow.exceptions import MlflowException

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        where = (self.run_dir / MLFLOW_DIR / "artifacts").resolve().as_uri() if local else None
        try:
            return self.client.create_experiment(name, artifact_location=where)
        except MlflowException:   # another run created it since
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log(self, step: int, values: dict[str, float]) -> None:
        """Metrics `values` at `step`: queued, after the previous batch has landed."""
        from mlflow.entities import Metric

        self._settle()
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        try:
            self.pending = self.client.log_batch(self.run_id, metrics=metrics, synchronous=False)
        except Exception as e:   # the queue refused it: the row is in metrics.csv, the run goes on
            self.failures.append(_first_line(e))

    def _settle(self) -> None:
        if self.pending is None:
            return
        try:
            self.pending.wait()
        except Exception as e:   # a batch that did not land
            self.failures.append(_first_line(e))
        self.pending = None

    def close(self) -> None:
        """The end of a run: the last batch, the end files as artifacts, the run FINISHED."""
        self._settle()
        try:
            for name in END_FILES:
                if (self.run_dir / name).is_file():
                    self.client.log_artifact(self.run_id, str(self.run_dir / name))
            self.client.set_terminated(self.run_id, "FINISHED")
        except Exception as e:
            self.failures.append(_first_line(e))
        self.done = True
        self._warn()

    def release(self) -> None:
        """A run that ended early: the run KILLED (a resume sets it RUNNING again), unless its server failed."""
        if self.done:
            return
        self.done = True
        self._settle()
        if not self.failures:
            try:
                self.client.set_terminated(self.run_id, "KILLED")
            except Exception as e:
                self.failures.append(_first_line(e))
        self._warn()

    def _warn(self) -> None:
        if self.failures:
            warnings.warn(f"MLflow: {len(self.failures)} write(s) to {self.uri} failed (the first: "
                          f"{self.failures[0]}); metrics.csv has every row", stacklevel=2)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
