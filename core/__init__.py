"""Ground level of rlpipe: small modules that every layer may import and that import nothing of
rlpipe themselves (docs/ARCHITECTURE.md, layers)."""
