"""rlpipe: envs."""
