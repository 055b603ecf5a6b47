"""`fedlora profiles fit RUN_DIR -o profiles.csv`: the clients' measured profiles from a run on
Flower (its node_times.csv), as the profile file that ``network.profiles_file`` reads and
whose rows (tau_full_s, t_full, a) are the ``clients`` of a `fedlora plan` PROBLEM.json.

The fit and its assumptions: `fedlora.federation.flower.measured` and docs/flower.md."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from pathlib import Path

from fedlora.errors import ConfigError, bad_value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profiles",
        help="client profiles measured on a Flower deployment",
        description="Client profiles (tau_full_s, t_full) measured on a Flower deployment.",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    fit = verbs.add_parser(
        "fit",
        help="fit profiles from a Flower run's node_times.csv",
        description=(
            "tau_full_s = the median of each node's measured local training time per round; "
            "t_full = its measured upload (parameters) x network.bits_per_param / the "
            "spectral efficiency (the run's simulated channel from clients.csv, or "
            "--spectral-efficiency). Writes CSV or JSON (by the extension of -o)."
        ),
    )
    fit.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of a Flower run")
    fit.add_argument("--output", "-o", required=True, metavar="profiles.csv|.json")
    fit.add_argument(
        "--spectral-efficiency",
        type=float,
        metavar="BIT_S_HZ",
        help="one spectral efficiency (bit/s/Hz) for every client instead of the run's channel",
    )
    fit.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from fedlora.federation.flower.measured import fit_profiles, read_node_times
    from fedlora.federation.rundir import load_run_config
    from fedlora.federation.runfiles import CLIENTS_FILE, read_clients

    run_dir = Path(args.run_dir)
    out = Path(args.output)
    if out.suffix.lower() not in (".csv", ".json"):
        raise bad_value("--output", str(out), "a .csv or .json file")
    se_arg = args.spectral_efficiency
    if se_arg is not None and not (math.isfinite(se_arg) and se_arg > 0):
        raise bad_value("--spectral-efficiency", se_arg, "a number of bit/s/Hz > 0")
    if not (run_dir / "config.toml").is_file():
        raise bad_value("RUN_DIR", str(run_dir), "a run directory (with config.toml)")
    cfg = load_run_config(run_dir)
    n = cfg.data.n_clients
    rows = read_node_times(run_dir, n)  # a client outside 0..n-1 is an error, not dropped
    clients = read_clients(run_dir / CLIENTS_FILE)
    if se_arg is not None:
        se = np.full(n, se_arg)
    else:
        se = np.array([c.spectral_efficiency for c in clients][:n])
    fitted = fit_profiles(rows, n, cfg.network.bits_per_param, se, source=str(run_dir))
    for row, client in zip(fitted, clients, strict=False):
        row["a"] = client.a
    if out.suffix.lower() == ".json":
        text = json.dumps({"clients": fitted}, indent=2) + "\n"
    else:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(fitted[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(fitted)
        text = buf.getvalue()
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--output = {str(out)!r}: cannot write: {e.strerror or e}") from None
    taus = ", ".join(f"{r['tau_full_s']:.3g}" for r in fitted)
    print(
        f"profiles of {n} clients from {len(rows)} measured replies: tau_full_s = [{taus}] -> {out}"
    )
    return 0
