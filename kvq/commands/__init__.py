"""kvq.commands: the implementations of ``kvq`` subcommands that need torch / transformers (imported on demand)."""
