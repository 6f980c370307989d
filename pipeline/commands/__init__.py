"""One module per `fucina` subcommand (discovered by pipeline.cli)."""
