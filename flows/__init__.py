"""rlpipe: flows."""
