"""rlpipe: training."""
