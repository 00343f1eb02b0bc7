"""rlpipe: models."""
