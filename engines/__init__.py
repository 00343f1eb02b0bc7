"""rlpipe: engines."""
