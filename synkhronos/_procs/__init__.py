"""synkhronos._procs."""
