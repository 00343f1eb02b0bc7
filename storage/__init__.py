"""rlpipe: storage."""
