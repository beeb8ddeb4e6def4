"""Experience between the producer and the learner: scoring (rewards, advantages, the log-prob recompute and
mismatch check) and the staleness-controlled replay buffer."""
