"""``kvtier bench cluster``: a real trace replayed through a cluster of real processes."""
