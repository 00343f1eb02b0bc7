"""rlpipe: where a training step's rollouts come from (sampling rounds, over-sampling, the group
buffer, the staleness bound, synchronous or running ahead of the trainer)."""
