"""rlpipe: tasks."""
