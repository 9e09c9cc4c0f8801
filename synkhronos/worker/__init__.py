"""The worker side: the loop every forked process runs."""
