"""``election_status``, ``election_resign`` and ``election_bucket``."""
