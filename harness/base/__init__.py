"""The bottom layer: helpers every other package may use, importing nothing of the harness above it
(atomic writes and digests, the cache root, hub reachability, device identity, the host-read counter)."""
