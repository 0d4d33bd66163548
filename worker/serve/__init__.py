"""The Redis serve loop around the engine: server.py (the engine thread), intake.py, completion.py and
leases.py (the three Redis threads), queue.py (every Redis call), messages.py (what the threads pass each
other), metrics.py."""
