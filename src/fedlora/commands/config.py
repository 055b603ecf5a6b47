"""`fedlora config show [--config F] [key=value ...]`: print the fully resolved TOML."""

from __future__ import annotations

import argparse

from fedlora.config.toml_io import dump_toml, load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="show the fully resolved configuration")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = csub.add_parser("show", help="print the resolved config as TOML")
    show.add_argument("--config", "-c", help="TOML file to start from (defaults otherwise)")
    show.add_argument("overrides", nargs="*", metavar="section.key=value")
    show.set_defaults(func=run_show)


def run_show(args: argparse.Namespace) -> int:
    from fedlora.federation.methods.registry import check_method_config, resolve_method_options
    from fedlora.federation.tracking import check_tracker_names

    cfg = load_config(args.config, args.overrides)
    check_method_config(cfg)  # method.name and the method's options (the registry)
    check_tracker_names(cfg)  # output.trackers: the tracker table's names
    # as a run records it: the chosen method's table [method.<name>] in full, no other
    print(dump_toml(resolve_method_options(cfg)), end="")
    return 0
