"""The arlo services; each runs with `python -m services.<name>`."""
