"""rlpipe: dashboards."""
