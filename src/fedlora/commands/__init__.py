"""One module per `fedlora` subcommand; each exposes ``register(subparsers)``."""
