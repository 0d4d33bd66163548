"""Interactive calls while they wait: one thread each for token streams, job ends and cancels (Background),
the server-sent events of a streamed answer (sse), and the per-key leases that bound what one key has in
flight (quotas)."""
