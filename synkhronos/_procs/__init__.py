"""Process supervision and the OS resources under it: waits, forked children and
the parent-death signal, the lock-file lease, launchers and MPI's bootstrap,
shared-memory names, signal handlers, a process's share of the cores."""
