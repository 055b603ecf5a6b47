"""MLflow's store for `fedlora.federation.tracking`: which tracking URI a run uses, the
URI's form checked before anything is written (no connection), and the MLflow run a resumed
run continues (``<run dir>/mlflow_run.json``, looked up in the store)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fedlora.config.experiment import ExperimentConfig
from fedlora.errors import ConfigError, cut, shown

MLFLOW_RUN_FILE = "mlflow_run.json"


def store_uri(cfg: ExperimentConfig) -> tuple[str, str]:
    """(the setting it comes from, the MLflow tracking URI); "" = the run's own store, which
    is output.mlflow_uri's default."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "")
    if cfg.output.mlflow_uri or not env:
        return "output.mlflow_uri", cfg.output.mlflow_uri
    return "$MLFLOW_TRACKING_URI", env


def own_store(run_dir: Path) -> str:
    return "sqlite:///" + str((run_dir / "mlflow.db").resolve())


STORE_FORMS = (
    '"" (the run\'s own sqlite:///<run dir>/mlflow.db), sqlite:///PATH.db, '
    "http(s)://HOST[:PORT], postgresql://..., mysql://..., mssql://..., databricks"
)
_DB_SCHEMES = ("postgresql", "mysql", "mssql")


def check_store_uri(field: str, uri: str) -> None:
    """The form of an MLflow tracking URI (nothing is opened): ConfigError naming `field`."""
    from urllib.parse import urlsplit

    def bad(why: str) -> ConfigError:
        return ConfigError(f"{field} = {shown(uri)} is invalid: {why}; allowed: {STORE_FORMS}")

    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError as e:
        raise bad(f"it does not parse as a URI ({e})") from None
    scheme = parts.scheme.lower()
    base = scheme.split("+", 1)[0]
    if uri in ("databricks", "databricks-uc") or base in ("databricks", "databricks-uc", "uc"):
        return
    if len(scheme) <= 1 or base == "file":  # a plain path (C:\... too): the file store
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("1", "true"):
            return
        raise bad(
            "a plain path or file: URI is MLflow's file store, which MLflow refuses unless "
            "MLFLOW_ALLOW_FILE_STORE=true; for a database there: sqlite:///PATH/mlflow.db"
        )
    if base == "sqlite":
        db = uri.split(":///", 1)[1] if ":///" in uri else ""
        if parts.netloc or (uri.rstrip("/") != "sqlite:" and ":///" not in uri):
            raise bad("an SQLite URI is sqlite:///relative.db or sqlite:////absolute.db")
        if db and db != ":memory:":
            path = Path(db)
            if path.exists() and not path.is_file():
                raise bad(f"{cut(str(path))!r} exists and is not a file")
            if not path.parent.is_dir():
                raise bad(f"the folder {cut(str(path.parent))!r} of the database does not exist")
        return
    if base in ("http", "https", *_DB_SCHEMES):
        if not parts.hostname:
            raise bad(f"a {base} URI names a host")
        return
    raise bad(f"unknown scheme {cut(scheme)!r}")


def stored_run(field: str, uri: str, run_dir: Path) -> str | None:
    """The MLflow run id that `run_dir`'s mlflow_run.json keeps for the store `uri` (None:
    no record, a damaged one, or one of another store: a new MLflow run); ConfigError when
    the store does not hold that run."""
    try:
        stored = json.loads((run_dir / MLFLOW_RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("tracking_uri") != uri:
        return None
    run_id = str(stored.get("run_id"))
    remedy = (
        f"point {field} at the store that holds it, restore the store, or move "
        f"{MLFLOW_RUN_FILE} away to continue in a new MLflow run"
    )
    where = f"{field} = {shown(uri)}: {run_dir / MLFLOW_RUN_FILE} names MLflow run {shown(run_id)}"
    if uri == own_store(run_dir) and not (run_dir / "mlflow.db").is_file():
        raise ConfigError(f"{where}, but {run_dir / 'mlflow.db'} does not exist: {remedy}")
    from mlflow.tracking import MlflowClient

    try:
        run = MlflowClient(tracking_uri=uri).get_run(run_id)
    except Exception as e:  # noqa: BLE001 - MLflow, SQLAlchemy, HTTP: all the store's
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"{where}, which the store cannot give ({cut(first)}): {remedy}"
        ) from None
    if run.info.lifecycle_stage == "deleted":
        raise ConfigError(f"{where}, which was deleted from the store: {remedy}")
    return run_id
