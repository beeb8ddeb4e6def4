"""What makes rollout batches: the batch maker, the group filter, the schedule, the asynchronous producer,
the rollout sources, and the pool of rollout worker processes with its remote adapter. What generates tokens
(the engines) is :mod:`bapo.engines`."""
