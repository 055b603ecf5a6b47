"""The node worker's own entry: `LocalDeployment` starts each node's worker as

    python -m fedlora.federation.flower.worker_main --port 7001 [--data-dir D] [--port-file F]

(the same worker as ``fedlora flower worker``, which calls `run`; the federation layer does
not launch the command line). Bad arguments exit 2 with one line naming the field; the
worker then checks the Flower environment, imports torch and the model code before it
listens, writes the bound port to ``--port-file`` (atomically) and serves until killed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from fedlora.errors import FedloraError
from fedlora.federation.flower.worker import check_serve_args, serve


def run(port: int, *, data_dir: str | None = None, port_file: str | None = None) -> None:
    """Serve on 127.0.0.1:`port` (0 = any free port) until killed; ConfigError for bad args."""
    from fedlora.federation.flower.common import apply_safe_env
    from fedlora.federation.flower.node import warm_imports

    check_serve_args(port, data_dir)
    apply_safe_env()
    warm_imports()  # before listening: the first request does not pay the torch import

    def ready(bound: int) -> None:
        if port_file:
            tmp = Path(port_file).with_suffix(".tmp")
            tmp.write_text(f"{bound}\n", encoding="utf-8")
            tmp.replace(port_file)

    serve(port, data_dir=data_dir, ready=ready)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fedlora.federation.flower.worker_main",
        description="node-local persistent fedlora worker (listens on 127.0.0.1 only)",
    )
    p.add_argument("--port", type=int, required=True, help="TCP port on 127.0.0.1 (0 = any)")
    p.add_argument("--data-dir", help="this node's copy of the data (sets data.data_dir)")
    p.add_argument("--port-file", help="write the bound port here once listening")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        run(args.port, data_dir=args.data_dir, port_file=args.port_file)
    except FedloraError as e:
        print(f"fedlora worker: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
